package ramfile

import (
	"context"
	"crypto/sha256"
	"sync"
	"sync/atomic"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
)

// compressedRegion is one region's frame, from a worker to the packer.
type compressedRegion struct {
	index  int // the region's place among the capture's, in offset order
	offset int64
	rawLen int
	data   []byte
	sum    [sha256.Size]byte // of data, by the worker
}

// packTarget is PackTarget; tests make packs smaller.
var packTarget = PackTarget

// packUploaders is how many packs upload at once, while the next fills:
// at most packUploaders+1 packs are in memory.
const packUploaders = 2

// sealedPack is a pack for an uploader: the n-th of this capture's.
type sealedPack struct {
	n    int
	data []byte
}

// regionFrame is a frame the packer placed: the region it holds and
// where, with the pack counted among the chain's.
type regionFrame struct {
	offset int64
	frame  Frame
}

// packer appends the workers' frames to packs in region order, and
// uploads each pack once it reaches PackTarget while the next fills (the
// uploaders digest it, in parallel with the packing).
type packer struct {
	ctx      context.Context
	cancel   context.CancelCauseFunc
	sink     chunk.BlobSink
	uploaded *atomic.Int64
	base     int // the parent's packs, before this capture's
	in       chan compressedRegion
	pending  map[int]compressedRegion // arrived before their turn
	next     int
	left     int // raw bytes of the frames still to come: sizes a new pack's buffer
	cur      []byte
	free     chan []byte // pack buffers, back from the uploaders
	uploads  chan sealedPack
	wg       sync.WaitGroup
	mu       sync.Mutex
	packs    []ocispec.Descriptor
	frames   []regionFrame
}

func newPacker(ctx context.Context, cancel context.CancelCauseFunc, sink chunk.BlobSink, uploaded *atomic.Int64, base, left int) *packer {
	p := &packer{ctx: ctx, cancel: cancel, sink: sink, uploaded: uploaded, base: base, left: left,
		in: make(chan compressedRegion), pending: map[int]compressedRegion{},
		free: make(chan []byte, packUploaders+1), uploads: make(chan sealedPack)}
	for range packUploaders {
		p.free <- nil
	}
	p.wg.Add(1 + packUploaders)
	go p.pack()
	for range packUploaders {
		go p.upload()
	}
	return p
}

// pack takes frames in any order and appends them in region order.
func (p *packer) pack() {
	defer p.wg.Done()
	defer close(p.uploads)
	for r := range p.in {
		if p.ctx.Err() != nil {
			continue
		}
		p.pending[r.index] = r
		for {
			r, ok := p.pending[p.next]
			if !ok {
				break
			}
			delete(p.pending, p.next)
			p.next++
			p.add(r)
		}
	}
	if len(p.cur) > 0 && p.ctx.Err() == nil {
		p.seal()
	}
}

// add appends one frame, sealing the pack first if it would pass
// PackTarget.
func (p *packer) add(r compressedRegion) {
	if len(p.cur) > 0 && len(p.cur)+len(r.data) > packTarget {
		if !p.seal() {
			return
		}
	}
	if cap(p.cur) == 0 {
		// Sized once: appending to a growing slice would copy a pack
		// several times over.
		p.cur = make([]byte, 0, min(packTarget+maxFrameLen, max(p.left, 0)+maxFrameLen))
	}
	p.left -= r.rawLen
	f := Frame{Pack: uint16(p.base + len(p.packs)), Offset: int64(len(p.cur)), Length: uint32(len(r.data)),
		RawLength: uint32(r.rawLen), SHA256: r.sum}
	p.frames = append(p.frames, regionFrame{offset: r.offset, frame: f})
	p.cur = append(p.cur, r.data...)
}

// seal hands the current pack to an uploader and takes a free buffer.
func (p *packer) seal() bool {
	p.mu.Lock()
	n := len(p.packs)
	p.packs = append(p.packs, ocispec.Descriptor{}) // the uploader's to fill in
	p.mu.Unlock()
	select {
	case p.uploads <- sealedPack{n: n, data: p.cur}:
	case <-p.ctx.Done():
		return false
	}
	select {
	case p.cur = <-p.free:
		p.cur = p.cur[:0]
		return true
	case <-p.ctx.Done():
		return false
	}
}

// upload digests and stores sealed packs.
func (p *packer) upload() {
	defer p.wg.Done()
	for s := range p.uploads {
		if p.ctx.Err() == nil {
			d := blobDesc(ociimage.MediaTypeRAMPack, s.data)
			p.mu.Lock()
			p.packs[s.n] = d
			p.mu.Unlock()
			if err := chunk.Put(p.ctx, p.sink, d, s.data, p.uploaded); err != nil {
				p.cancel(err)
			}
		}
		p.free <- s.data
	}
}

// finish waits for the last pack's upload, once every frame is in.
func (p *packer) finish() {
	close(p.in)
	p.wg.Wait()
}
