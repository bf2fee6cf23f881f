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
}

// regionFrame is a frame the packer placed: the region it holds and
// where, with the pack counted among the chain's.
type regionFrame struct {
	offset int64
	frame  Frame
}

// packer appends the workers' frames to packs in region order, and
// uploads each pack once it reaches PackTarget while the next fills: at
// most two packs are in memory.
type packer struct {
	ctx      context.Context
	cancel   context.CancelCauseFunc
	sink     chunk.BlobSink
	uploaded *atomic.Int64
	base     int // the parent's packs, before this capture's
	in       chan compressedRegion
	pending  map[int]compressedRegion // arrived before their turn
	next     int
	cur      []byte
	free     chan []byte // pack buffers, back from the uploader
	uploads  chan []byte
	wg       sync.WaitGroup
	mu       sync.Mutex
	packs    []ocispec.Descriptor
	frames   []regionFrame
}

func newPacker(ctx context.Context, cancel context.CancelCauseFunc, sink chunk.BlobSink, uploaded *atomic.Int64, base int) *packer {
	p := &packer{ctx: ctx, cancel: cancel, sink: sink, uploaded: uploaded, base: base,
		in: make(chan compressedRegion), pending: map[int]compressedRegion{},
		free: make(chan []byte, 2), uploads: make(chan []byte)}
	p.free <- nil
	p.free <- nil
	p.cur = <-p.free
	p.wg.Add(2)
	go p.pack()
	go p.upload()
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
	if len(p.cur) > 0 && len(p.cur)+len(r.data) > PackTarget {
		if !p.seal() {
			return
		}
	}
	f := Frame{Pack: uint16(p.base + len(p.packs)), Offset: int64(len(p.cur)), Length: uint32(len(r.data)),
		RawLength: uint32(r.rawLen), SHA256: sha256.Sum256(r.data)}
	p.frames = append(p.frames, regionFrame{offset: r.offset, frame: f})
	p.cur = append(p.cur, r.data...)
}

// seal hands the current pack to the uploader and takes a free buffer.
func (p *packer) seal() bool {
	d := blobDesc(ociimage.MediaTypeRAMPack, p.cur)
	p.mu.Lock()
	p.packs = append(p.packs, d)
	p.mu.Unlock()
	select {
	case p.uploads <- p.cur:
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

// upload stores the sealed packs, in order.
func (p *packer) upload() {
	defer p.wg.Done()
	n := 0
	for data := range p.uploads {
		p.mu.Lock()
		d := p.packs[n]
		p.mu.Unlock()
		n++
		if p.ctx.Err() == nil {
			if err := chunk.Put(p.ctx, p.sink, d, data, p.uploaded); err != nil {
				p.cancel(err)
			}
		}
		p.free <- data
	}
}

// finish waits for the last pack's upload, once every frame is in.
func (p *packer) finish() {
	close(p.in)
	p.wg.Wait()
}
