package chunk

import (
	"context"
	"io"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// decodeResult is one chunk's outcome, in its slot.
type decodeResult struct {
	data []byte // decompressed, in buf
	buf  []byte // from bufs
	err  error
}

// decodeRun is the state DecodeStream's feeder, decompressors and writer
// share. There is one result slot per chunk; the writer takes them in
// order. The window bounds how far fetching runs ahead of writing.
type decodeRun struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	layers []ocispec.Descriptor
	src    BlobSource
	slots  []chan decodeResult
	window chan struct{}
	next   chan int
	bufs   *bufferPool
}

// newDecodeRun makes the slots, the window and the buffers for layers,
// which ValidateLayers has accepted.
func newDecodeRun(ctx context.Context, cancel context.CancelCauseFunc, layers []ocispec.Descriptor, src BlobSource, workers int) *decodeRun {
	d := &decodeRun{
		ctx:    ctx,
		cancel: cancel,
		layers: layers,
		src:    src,
		slots:  make([]chan decodeResult, len(layers)),
		window: make(chan struct{}, 2*workers),
		next:   make(chan int),
	}
	for i := range d.slots {
		d.slots[i] = make(chan decodeResult, 1)
	}
	// A chunk's buffer is taken after its window token and given back once
	// it is written, so one buffer per token is enough, reused throughout.
	largest := 0
	for _, l := range layers {
		n, _ := rawSize(l) // validated by the caller
		largest = max(largest, n)
	}
	d.bufs = newBufferPool(cap(d.window), largest)
	return d
}

// decompressor fetches and decompresses the chunks it is given until next
// is closed, each into its slot.
func (d *decodeRun) decompressor() {
	dec, err := NewDecoder()
	if err != nil {
		d.cancel(errcode.Wrap(errcode.Internal, err, "zstd decoder"))
		return
	}
	defer dec.Close()
	for i := range d.next {
		buf, err := d.bufs.get(d.ctx)
		var data []byte
		if err == nil {
			// Safely: a chunk is what the store gave, untrusted.
			err = errcode.Safely(func() (err error) {
				data, err = fetchChunk(d.ctx, d.src, dec, d.layers[i], buf)
				return err
			})
		}
		d.slots[i] <- decodeResult{data, buf, err}
	}
}

// feed hands out the chunks' indexes in order, each once it has a window
// token, and closes next when done or cancelled.
func (d *decodeRun) feed() {
	defer close(d.next)
	for i := range d.layers {
		select {
		case d.window <- struct{}{}:
		case <-d.ctx.Done():
			return
		}
		select {
		case d.next <- i:
		case <-d.ctx.Done():
			return
		}
	}
}

// writeInOrder writes the chunks to w in order as their results come in,
// giving back each one's buffer and window token; it stops at the first
// error.
func (d *decodeRun) writeInOrder(w io.Writer, progress func(int64)) (written int64, err error) {
	for i := range d.layers {
		var res decodeResult
		select {
		case res = <-d.slots[i]:
		case <-d.ctx.Done():
			// We were waiting for the store (a worker's own failure has
			// its code already).
			err = errcode.Ensure(errcode.RegistryError, context.Cause(d.ctx), "waiting for chunk %d of %d from the image store", i+1, len(d.layers))
		}
		if err == nil {
			err = res.err
		}
		if err == nil {
			if _, werr := w.Write(res.data); werr != nil {
				err = errcode.Ensure(errcode.Internal, werr, "writing chunk %d of %d", i+1, len(d.layers))
			}
		}
		if err != nil {
			break
		}
		written += int64(len(res.data))
		d.bufs.put(res.buf)
		<-d.window
		if progress != nil {
			progress(written)
		}
	}
	return written, err
}
