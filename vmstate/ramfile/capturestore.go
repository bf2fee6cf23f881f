package ramfile

import (
	"context"
	"crypto/sha256"
	"sync"
	"sync/atomic"

	"github.com/klauspost/compress/zstd"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
)

// regionJob is one region's blob, built by the reader for a worker.
type regionJob struct {
	index  int
	offset int64
	raw    []byte
	pages  []uint32 // the pages raw holds, in order
}

// regionStore is one Store's pipeline: a reader builds each region's blob
// from the staging file in order, workers compress them, the packer packs
// and uploads them. The first error cancels ctx with its cause.
type regionStore struct {
	c        *Capture
	sink     chunk.BlobSink
	opts     StoreOptions
	ctx      context.Context
	cancel   context.CancelCauseFunc
	jobs     chan regionJob
	bufs     chan []byte // the reader's buffers, back from the workers
	uploaded *atomic.Int64
	done     atomic.Int64 // pages handed to the workers
	wg       sync.WaitGroup
	packer   *packer
}

// startWorkers starts opts.Workers workers that store the reader's jobs.
func (s *regionStore) startWorkers() {
	for range s.opts.Workers {
		s.wg.Add(1)
		go s.work()
	}
}

func (s *regionStore) work() {
	defer s.wg.Done()
	enc, err := chunk.NewEncoder(s.opts.Level)
	if err != nil {
		s.cancel(errcode.Wrap(errcode.Internal, err, "zstd encoder"))
		return
	}
	for j := range s.jobs {
		s.storeRegion(enc, j)
		s.bufs <- j.raw[:0]
	}
}

// storeRegion fills in the strong hashes of the region's pages, then
// (unless the store failed already) compresses its blob and hands the
// frame to the packer.
func (s *regionStore) storeRegion(enc *zstd.Encoder, j regionJob) {
	m := s.c.Map
	for k, page := range j.pages {
		if !m.IsZero(int(page)) {
			at := headerSize + k*PageSize
			m.strong[m.index(int(page))] = strongHashOf(j.raw[at : at+PageSize])
		}
	}
	if s.ctx.Err() != nil {
		return
	}
	data := enc.EncodeAll(j.raw, make([]byte, 0, len(j.raw)/2+1024))
	select {
	case s.packer.in <- compressedRegion{index: j.index, offset: j.offset, rawLen: len(j.raw), data: data, sum: sha256.Sum256(data)}:
	case <-s.ctx.Done():
	}
}

// readRegions hands the workers every region that holds a changed page,
// in order, and closes jobs when it is done or the store failed.
func (s *regionStore) readRegions() error {
	defer close(s.jobs)
	c := s.c
	var staged int64 // offset in the staging file of the next non-zero page
	for i, index := 0, 0; i < len(c.changed); index++ {
		region := int64(c.changed[i]) * PageSize / RegionSize
		var bitmap [pagesPerRegion / 8]byte
		var raw []byte
		select {
		case raw = <-s.bufs:
		case <-s.ctx.Done():
			return context.Cause(s.ctx)
		}
		raw = raw[:headerSize]
		first := i
		for ; i < len(c.changed) && int64(c.changed[i])*PageSize/RegionSize == region; i++ {
			p := int(c.changed[i]) % pagesPerRegion
			bitmap[p/8] |= 1 << (p % 8)
			n := len(raw)
			raw = raw[:n+PageSize]
			if c.Map.IsZero(int(c.changed[i])) {
				clear(raw[n:])
				continue
			}
			at := staged
			if c.shadow {
				at = int64(c.changed[i]) * PageSize
			}
			if _, err := c.staging.ReadAt(raw[n:], at); err != nil {
				return errcode.Wrap(errcode.Internal, err, "reading the RAM staging file")
			}
			staged += PageSize
		}
		copy(raw, regionHeader(region*RegionSize, &bitmap))
		if s.opts.Progress != nil {
			s.opts.Progress(s.done.Add(int64(len(raw)-headerSize) / PageSize))
		}
		select {
		case s.jobs <- regionJob{index: index, offset: region * RegionSize, raw: raw, pages: c.changed[first:i]}:
		case <-s.ctx.Done():
			return context.Cause(s.ctx)
		}
	}
	return nil
}

// storePageMap stores the page map, in pieces, once the workers have
// filled in the strong hashes of the pages they stored.
func (c *Capture) storePageMap(ctx context.Context, sink chunk.BlobSink, level zstd.EncoderLevel, uploaded *atomic.Int64) ([]ocispec.Descriptor, error) {
	enc, err := chunk.NewEncoder(level)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "zstd encoder")
	}
	var out []ocispec.Descriptor
	for first := 0; first < c.Map.Len(); first += pageMapPiece {
		n := min(pageMapPiece, c.Map.Len()-first)
		data, err := encodePageMap(enc, c.Map, first, n)
		if err != nil {
			return out, err
		}
		d := pageMapDesc(first, n, data)
		if err := chunk.Put(ctx, sink, d, data, uploaded); err != nil {
			return out, err
		}
		out = append(out, d)
	}
	return out, nil
}
