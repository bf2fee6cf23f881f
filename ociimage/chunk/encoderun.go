package chunk

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// encodeRun is the state EncodeStream's three stages share: the reader
// feeds jobs, the compressors feed uploads, the uploaders store.
type encodeRun struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	opts   StreamOptions
	sink   BlobSink
	// digesting is sink if it digests what it stores in its own pass over
	// the bytes (imgcrypt's encrypting store): the compressors leave the
	// digest to it, and a chunk is recorded once stored.
	digesting         undigestedAdder
	rawBufs, compBufs *bufferPool
	jobs              chan chunkJob
	uploads           chan uploadJob

	// storeErr is the first store failure. When the caller's deadline cuts
	// a put short, it says what we were waiting for, with its code; the
	// context's cause is only a bare deadline then.
	storeErr         atomic.Pointer[error]
	stored, uploaded atomic.Int64

	mu     sync.Mutex
	layers []ocispec.Descriptor
	seen   map[digest.Digest]bool // chunks put (or being put) by this stream
}

// record sets the chunk at index and says whether its digest is new to
// this stream.
func (e *encodeRun) record(index int, desc ocispec.Descriptor) (first bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for len(e.layers) <= index {
		e.layers = append(e.layers, ocispec.Descriptor{})
	}
	e.layers[index] = desc
	first = !e.seen[desc.Digest]
	e.seen[desc.Digest] = true
	return first
}

// uploader stores the compressed chunks it is given until uploads is
// closed, and gives every buffer back, stored or not.
func (e *encodeRun) uploader() {
	for job := range e.uploads {
		if e.ctx.Err() == nil {
			e.store(job)
		}
		e.compBufs.put(job.data)
	}
}

// store puts one chunk into the sink; its failure cancels the stream.
func (e *encodeRun) store(job uploadJob) {
	// Safely: the store reads what a registry answers.
	err := errcode.Safely(func() error {
		if e.digesting == nil {
			return Put(e.ctx, e.sink, job.desc, job.data, &e.uploaded)
		}
		desc, err := putUndigested(e.ctx, e.digesting, job.desc, job.data, &e.uploaded)
		if err == nil {
			e.record(job.index, desc)
		}
		return err
	})
	if err != nil {
		e.storeErr.CompareAndSwap(nil, &err)
		e.cancel(err)
	}
}

// compressor compresses the chunks it is given until jobs is closed.
func (e *encodeRun) compressor() {
	enc, err := NewEncoder(e.opts.Level)
	if err != nil {
		e.cancel(errcode.Wrap(errcode.Internal, err, "zstd encoder"))
		return
	}
	defer enc.Close()
	for job := range e.jobs {
		e.compress(enc, job)
	}
}

// compress compresses one chunk and hands it to the uploaders, unless the
// stream has it already or was cancelled (then it only gives its buffers
// back, draining jobs).
func (e *encodeRun) compress(enc *zstd.Encoder, job chunkJob) {
	out, err := e.compBufs.get(e.ctx)
	if err != nil {
		e.rawBufs.put(job.raw)
		return
	}
	out = enc.EncodeAll(job.raw, out[:0])
	desc := ocispec.Descriptor{
		MediaType: ociimage.MediaTypeChunk,
		Size:      int64(len(out)),
		Annotations: map[string]string{
			ociimage.AnnotationRawSize:   strconv.Itoa(len(job.raw)),
			ociimage.AnnotationRawOffset: strconv.FormatInt(job.offset, 10),
		},
	}
	e.rawBufs.put(job.raw)
	if desc.Size > ociimage.MaxChunkSize { // cannot happen with maxAverageChunk; never store it
		e.cancel(errcode.New(errcode.Internal, "chunk %d compressed to %d bytes, over the %d a chunk may have", job.index, desc.Size, ociimage.MaxChunkSize))
		e.compBufs.put(out)
		return
	}
	e.stored.Add(desc.Size)
	if e.digesting == nil {
		desc.Digest = digest.NewDigestFromBytes(digest.SHA256, sha256Sum(out))
		if !e.record(job.index, desc) {
			e.compBufs.put(out) // a repeat of a chunk already on its way
			return
		}
	}
	select {
	case e.uploads <- uploadJob{index: job.index, desc: desc, data: out}:
	case <-e.ctx.Done():
		e.compBufs.put(out)
	}
}
