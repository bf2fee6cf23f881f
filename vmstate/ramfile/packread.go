package ramfile

import (
	"context"
	"crypto/sha256"
	"strconv"

	"github.com/klauspost/compress/zstd"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
)

// LoadIndex fetches the image's index (its digest verified by src) and
// parses and checks it against the manifest's packs (ParseIndex).
func LoadIndex(ctx context.Context, layers Layers, src chunk.BlobSource, size int64) (*Index, error) {
	if layers.Index == nil {
		return nil, errcode.New(errcode.InvalidInput, "the image has no RAM index")
	}
	data, err := src.Blob(ctx, *layers.Index, ociimage.MaxChunkSize)
	if err != nil {
		return nil, err
	}
	return DecodeIndex(data, size, layers.Packs)
}

// packJob is one frame of a fetched pack, for a worker.
type packJob struct {
	pack   []byte
	region *RegionEntry
	frame  Frame
}

// materializePacks is Materialize for the pack format: the index is
// loaded and checked, then the packs are fetched whole (each verified by
// its digest), newest first, the next one while the workers decode this
// one; every frame is checked against its SHA-256, decompressed to its
// raw length, its header against its region, and written where no newer
// frame wrote. A region of one frame is checked against its hash as it
// is decoded, one of several once every pack is applied (checkRegions):
// no QEMU maps a file whose regions are not what the page map says.
func (m *materializer) materializePacks(ctx context.Context, layers Layers) error {
	x, err := LoadIndex(ctx, layers, m.src, m.size)
	if err != nil {
		return err
	}
	byPack := make([][]packJob, len(x.Packs))
	for i := range x.Regions {
		r := &x.Regions[i]
		for _, f := range r.Frames {
			byPack[f.Pack] = append(byPack[f.Pack], packJob{region: r, frame: f})
		}
	}
	fetched := m.prefetch(ctx, layers.Packs)
	for p := len(layers.Packs) - 1; p >= 0; p-- {
		got := <-fetched
		if got.err != nil {
			return got.err
		}
		if err := m.applyPack(ctx, got.data, byPack[p]); err != nil {
			return err
		}
		n := m.fetched.Add(layers.Packs[p].Size)
		if m.opts.Progress != nil {
			m.opts.Progress(n)
		}
		if err := checkAllocated(m.f, m.opts.MaxDataBytes); err != nil {
			return err
		}
	}
	return m.checkRegions(ctx, x)
}

type fetchedPack struct {
	data []byte
	err  error
}

// prefetch fetches packs newest first, one ahead of the caller: at most
// two packs are in memory.
func (m *materializer) prefetch(ctx context.Context, packs []ocispec.Descriptor) <-chan fetchedPack {
	out := make(chan fetchedPack, 1)
	go func() {
		defer close(out)
		for p := len(packs) - 1; p >= 0; p-- {
			var got fetchedPack
			got.err = errcode.Safely(func() (err error) {
				got.data, err = m.src.Blob(ctx, packs[p], ociimage.MaxPackSize)
				return err
			})
			select {
			case out <- got:
			case <-ctx.Done():
				return
			}
			if got.err != nil {
				return
			}
		}
	}()
	return out
}

// applyPack decodes and writes one pack's frames, on the workers: a pack
// holds at most one frame of a region, so they never write the same page.
func (m *materializer) applyPack(ctx context.Context, pack []byte, jobs []packJob) error {
	return decodeEach(ctx, m.opts.Workers, jobs, func(_ context.Context, dec *zstd.Decoder, buf []byte, j packJob) error {
		j.pack = pack
		return m.frame(j, dec, buf)
	})
}

// frame checks one frame (SHA-256, raw length, header) and writes it.
func (m *materializer) frame(j packJob, dec *zstd.Decoder, buf []byte) error {
	f := j.frame
	data := j.pack[f.Offset : f.Offset+int64(f.Length)]
	if sha256.Sum256(data) != f.SHA256 {
		return errcode.New(errcode.DigestMismatch, "the frame of RAM region %d in pack %d does not match its SHA-256 in the index: the image is corrupt or was altered; nothing was loaded", j.region.Offset, f.Pack)
	}
	raw, err := dec.DecodeAll(data, buf[:0:f.RawLength])
	if err != nil || len(raw) != int(f.RawLength) {
		return errcode.New(errcode.InvalidInput, "the frame of RAM region %d in pack %d does not decompress to its declared %d bytes", j.region.Offset, f.Pack, f.RawLength)
	}
	r, err := parseRegion(raw, "at "+strconv.FormatInt(j.region.Offset, 10), j.region.Offset, m.size)
	if err != nil {
		return err
	}
	if len(j.region.Frames) == 1 && decodedHash(r, m.size) != j.region.Hash {
		return regionMismatch(j.region.Offset)
	}
	return m.write(r)
}

// decodedHash is the content hash of a region that one frame makes whole.
func decodedHash(r region, size int64) [sha256.Size]byte {
	at := make([]int, pagesPerRegion)
	n := 0
	for i := range pagesPerRegion {
		at[i] = -1
		if r.has(i) {
			at[i], n = n, n+1
		}
	}
	return regionHash(func(k int) strongHash {
		if at[k] < 0 {
			return strongHash{}
		}
		return pageStrong(r.pages[at[k]*PageSize : (at[k]+1)*PageSize])
	}, pagesIn(r.offset, size))
}

// pageStrong is a page's strong hash as a page map has it: zeros for a
// page of zeros.
func pageStrong(p []byte) strongHash {
	if isZero(p) {
		return strongHash{}
	}
	return strongHashOf(p)
}

// checkRegions reads back every region that several frames made and
// checks it against its hash.
func (m *materializer) checkRegions(ctx context.Context, x *Index) error {
	buf := make([]byte, RegionSize)
	for _, r := range x.Regions {
		if len(r.Frames) == 1 {
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		n := pagesIn(r.Offset, m.size)
		if _, err := m.f.ReadAt(buf[:n*PageSize], r.Offset); err != nil {
			return errcode.Wrap(errcode.Internal, err, "reading the RAM file back")
		}
		h := regionHash(func(k int) strongHash { return pageStrong(buf[k*PageSize : (k+1)*PageSize]) }, n)
		if h != r.Hash {
			return regionMismatch(r.Offset)
		}
	}
	return nil
}

func regionMismatch(off int64) error {
	return errcode.New(errcode.DigestMismatch, "RAM region at %d does not match its hash in the index once its frames applied: the chain's packs hold other pages than the page map says (a forged or corrupt parent?); nothing was loaded", off)
}
