package ramfile

import (
	"context"
	"sync/atomic"

	"github.com/klauspost/compress/zstd"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
)

// StoreOptions tunes Store.
type StoreOptions struct {
	Workers  int               // regions compressed at once (default 2)
	Level    zstd.EncoderLevel // default SpeedFastest
	Progress func(pagesDone int64)
	// Parent is the index of the checkpoint this capture is a delta on
	// (nil for a base): the new index covers the chain, the parent's packs
	// first.
	Parent *Index
}

// Stored is what Store put in the store.
type Stored struct {
	PageMap []ocispec.Descriptor
	// Index is the chain's index; Packs this capture's packs, which come
	// after the parent's in the manifest.
	Index         ocispec.Descriptor
	Packs         []ocispec.Descriptor
	Frames        int   // regions this capture stored
	StoredBytes   int64 // compressed bytes of its page map, packs and index
	UploadedBytes int64 // of which the store did not have yet
}

// Store compresses the capture's changed pages into one frame per region
// that has any, packed into packs of about PackTarget bytes, its page map
// into page-map layers, and the chain's index, and puts every blob the
// sink lacks. Memory is bounded by the workers' buffers and two packs.
func (c *Capture) Store(ctx context.Context, sink chunk.BlobSink, opts StoreOptions) (Stored, error) {
	var out Stored
	if opts.Workers <= 0 {
		opts.Workers = 2
	}
	if opts.Level == 0 {
		opts.Level = zstd.SpeedFastest
	}
	base := 0
	if opts.Parent != nil {
		base = len(opts.Parent.Packs)
	}
	var uploaded atomic.Int64
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	s := &regionStore{c: c, sink: sink, opts: opts, ctx: ctx, cancel: cancel, uploaded: &uploaded,
		jobs: make(chan regionJob), bufs: make(chan []byte, opts.Workers+1), packer: newPacker(ctx, cancel, sink, &uploaded, base, int(c.StagedBytes)+c.Regions()*headerSize)}
	for range opts.Workers + 1 {
		s.bufs <- make([]byte, 0, maxRegionRaw)
	}
	s.startWorkers()
	readErr := s.readRegions()
	s.wg.Wait()
	s.packer.finish()
	if readErr != nil {
		return out, readErr
	}
	if err := context.Cause(ctx); err != nil {
		return out, err
	}
	var err error
	if out.PageMap, err = c.storePageMap(ctx, sink, opts.Level, &uploaded); err != nil {
		return out, err
	}
	out.Packs, out.Frames = s.packer.packs, len(s.packer.frames)
	x := chainIndex(opts.Parent, c.Size, out.Packs, s.packer.frames, c.Map)
	if out.Index, err = storeIndex(ctx, sink, x, opts.Level, &uploaded); err != nil {
		return out, err
	}
	for _, d := range append(append(append([]ocispec.Descriptor(nil), out.PageMap...), out.Packs...), out.Index) {
		out.StoredBytes += d.Size
	}
	out.UploadedBytes = uploaded.Load()
	return out, nil
}

// chainIndex is the index of the capture's frames on top of the parent's
// (nil for a base), every region's hash from the capture's page map.
func chainIndex(parent *Index, size int64, own []ocispec.Descriptor, frames []regionFrame, m *PageMap) *Index {
	x := &Index{FileSize: size}
	var old []RegionEntry
	if parent != nil {
		x.Packs = append(x.Packs, parent.Packs...)
		old = parent.Regions
	}
	for _, d := range own {
		x.Packs = append(x.Packs, PackRef{Digest: d.Digest, Size: d.Size})
	}
	for len(old) > 0 || len(frames) > 0 {
		var e RegionEntry
		switch {
		case len(frames) == 0 || len(old) > 0 && old[0].Offset < frames[0].offset:
			e, old = RegionEntry{Offset: old[0].Offset, Frames: old[0].Frames}, old[1:]
		case len(old) > 0 && old[0].Offset == frames[0].offset:
			e = RegionEntry{Offset: old[0].Offset, Frames: append(append([]Frame(nil), old[0].Frames...), frames[0].frame)}
			old, frames = old[1:], frames[1:]
		default:
			e, frames = RegionEntry{Offset: frames[0].offset, Frames: []Frame{frames[0].frame}}, frames[1:]
		}
		e.Hash = mapRegionHash(m, e.Offset)
		x.Regions = append(x.Regions, e)
	}
	return x
}

// storeIndex compresses the index and puts it.
func storeIndex(ctx context.Context, sink chunk.BlobSink, x *Index, level zstd.EncoderLevel, uploaded *atomic.Int64) (ocispec.Descriptor, error) {
	raw := x.Encode()
	if len(raw) > MaxIndexBytes {
		return ocispec.Descriptor{}, errcode.New(errcode.Internal, "the RAM index would take %d bytes, more than %d: checkpoint with a shorter chain (%s)", len(raw), MaxIndexBytes, errcode.Field("maxChain"))
	}
	enc, err := chunk.NewEncoder(level)
	if err != nil {
		return ocispec.Descriptor{}, errcode.Wrap(errcode.Internal, err, "zstd encoder")
	}
	data := enc.EncodeAll(raw, nil)
	if len(data) > ociimage.MaxChunkSize {
		return ocispec.Descriptor{}, errcode.New(errcode.Internal, "the RAM index takes %d bytes compressed, more than %d: checkpoint with a shorter chain (%s)", len(data), ociimage.MaxChunkSize, errcode.Field("maxChain"))
	}
	d := blobDesc(ociimage.MediaTypeRAMIndex, data)
	return d, chunk.Put(ctx, sink, d, data, uploaded)
}

// IndexBytes is how many bytes the index of a delta on parent (nil: a
// base) that stores regions more regions would take at most: a checkpoint
// past MaxIndexBytes starts a fresh base instead.
func IndexBytes(parent *Index, regions int) int {
	packs := PacksFor(regions)
	n := indexHeaderSize + regions*(indexRegionSize+indexFrameSize) + packs*indexPackSize
	if parent != nil {
		n += parent.encodedSize()
	}
	return n
}

// PacksFor is the most packs a capture of regions regions makes.
func PacksFor(regions int) int { return regions*maxFrameLen/PackTarget + 1 }
