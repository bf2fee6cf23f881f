package vmstate

import (
	"context"
	"crypto/sha256"
	"io"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// BlobSink is where EncodeStream puts compressed chunks. ociimage.Repository
// satisfies it.
type BlobSink interface {
	HasBlob(ctx context.Context, d digest.Digest) (bool, error)
	PutBlob(ctx context.Context, desc ocispec.Descriptor, data []byte) error
}

// BlobSource is where DecodeStream gets compressed chunks from. Blob must
// return only bytes that match desc's digest. ociimage.Repository satisfies it.
type BlobSource interface {
	Blob(ctx context.Context, desc ocispec.Descriptor, limit int64) ([]byte, error)
}

// StreamOptions tunes both directions of the chunk pipeline. The zero value
// picks the defaults.
type StreamOptions struct {
	// ChunkSize is the raw size of every chunk but the last (default 4 MiB).
	ChunkSize int
	// Workers is how many chunks are compressed, stored, fetched or
	// decompressed at once (default GOMAXPROCS, at least 2).
	Workers int
	// Level is the zstd level (default zstd.SpeedDefault, about zstd -3).
	Level zstd.EncoderLevel
	// Progress, if set, is called with the raw bytes done so far, from one
	// goroutine at a time.
	Progress func(rawBytes int64)
}

const defaultChunkSize = 4 << 20

func (o StreamOptions) withDefaults() StreamOptions {
	if o.ChunkSize <= 0 {
		o.ChunkSize = defaultChunkSize
	}
	if o.ChunkSize > ociimage.MaxChunkSize {
		o.ChunkSize = ociimage.MaxChunkSize
	}
	if o.Workers <= 0 {
		o.Workers = max(runtime.GOMAXPROCS(0), 2)
	}
	if o.Level == 0 {
		o.Level = zstd.SpeedDefault
	}
	return o
}

// StreamResult describes an encoded stream.
type StreamResult struct {
	Layers        []ocispec.Descriptor // chunks in stream order
	RawBytes      int64                // bytes read from the stream
	StoredBytes   int64                // compressed bytes of all chunks
	UploadedBytes int64                // compressed bytes the sink did not have yet
}

type chunkJob struct {
	index  int
	offset int64
	raw    []byte
}

// EncodeStream reads r to its end, cuts it into chunks, compresses and
// digests each chunk once, concurrently, and puts every chunk the sink does
// not have yet. Memory is bounded by about 2*Workers chunks whatever the
// stream's size: the reader blocks (and so back-pressures QEMU) while every
// worker is busy.
func EncodeStream(ctx context.Context, r io.Reader, sink BlobSink, opts StreamOptions) (StreamResult, error) {
	opts = opts.withDefaults()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)

	var (
		mu       sync.Mutex
		layers   []ocispec.Descriptor
		stored   atomic.Int64
		uploaded atomic.Int64
	)
	pool := sync.Pool{New: func() any { b := make([]byte, opts.ChunkSize); return &b }}
	jobs := make(chan chunkJob, opts.Workers)

	var wg sync.WaitGroup
	for range opts.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Chunks are compressed on their own, so a window larger than a
			// chunk buys nothing and costs memory (zstd's default keeps
			// about 18 MiB per encoder).
			enc, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(opts.Level), zstd.WithEncoderConcurrency(1),
				zstd.WithWindowSize(windowFor(opts.ChunkSize)))
			if err != nil {
				cancel(errcode.Wrap(errcode.Internal, err, "zstd encoder"))
				return
			}
			defer enc.Close()
			for job := range jobs {
				if ctx.Err() != nil {
					continue // drain
				}
				// A fresh buffer per chunk: a store may hold on to data
				// (an HTTP body) after PutBlob returns.
				out := enc.EncodeAll(job.raw, make([]byte, 0, len(job.raw)/2))
				desc := ocispec.Descriptor{
					MediaType: ociimage.MediaTypeChunk,
					Digest:    digest.NewDigestFromBytes(digest.SHA256, sha256Sum(out)),
					Size:      int64(len(out)),
					Annotations: map[string]string{
						ociimage.AnnotationRawSize:   strconv.Itoa(len(job.raw)),
						ociimage.AnnotationRawOffset: strconv.FormatInt(job.offset, 10),
					},
				}
				buf := job.raw[:cap(job.raw)]
				pool.Put(&buf)
				if err := putOnce(ctx, sink, desc, out, &uploaded); err != nil {
					cancel(err)
					continue
				}
				stored.Add(desc.Size)
				mu.Lock()
				for len(layers) <= job.index {
					layers = append(layers, ocispec.Descriptor{})
				}
				layers[job.index] = desc
				mu.Unlock()
			}
		}()
	}

	raw, readErr := readChunks(ctx, r, &pool, jobs, opts)
	close(jobs)
	wg.Wait()

	// A worker's failure (or the caller's cancellation) is the cause; the
	// reader's error is only the symptom then.
	if err := context.Cause(ctx); err != nil {
		return StreamResult{}, err
	}
	if readErr != nil {
		return StreamResult{}, readErr
	}
	return StreamResult{Layers: layers, RawBytes: raw, StoredBytes: stored.Load(), UploadedBytes: uploaded.Load()}, nil
}

// readChunks fills chunks from r and hands them to the workers; it returns the
// number of raw bytes read.
func readChunks(ctx context.Context, r io.Reader, pool *sync.Pool, jobs chan<- chunkJob, opts StreamOptions) (int64, error) {
	var offset int64
	for index := 0; ; index++ {
		bp := pool.Get().(*[]byte)
		n, err := io.ReadFull(r, *bp)
		if n > 0 {
			select {
			case jobs <- chunkJob{index: index, offset: offset, raw: (*bp)[:n]}:
			case <-ctx.Done():
				return offset, context.Cause(ctx)
			}
			offset += int64(n)
			if opts.Progress != nil {
				opts.Progress(offset)
			}
		}
		switch {
		case err == io.EOF || err == io.ErrUnexpectedEOF:
			return offset, nil
		case err != nil:
			return offset, errcode.Ensure(errcode.Internal, err, "reading the state stream")
		}
	}
}

func putOnce(ctx context.Context, sink BlobSink, desc ocispec.Descriptor, data []byte, uploaded *atomic.Int64) error {
	have, err := sink.HasBlob(ctx, desc.Digest)
	if err != nil {
		return errcode.Ensure(errcode.RegistryError, err, "checking for chunk %s", desc.Digest)
	}
	if have {
		return nil
	}
	if err := sink.PutBlob(ctx, desc, data); err != nil {
		return errcode.Ensure(errcode.RegistryError, err, "storing chunk %s", desc.Digest)
	}
	uploaded.Add(desc.Size)
	return nil
}

func sha256Sum(b []byte) []byte {
	s := sha256.Sum256(b)
	return s[:]
}

// rawSize returns a chunk layer's declared raw size, bounded by MaxChunkSize.
func rawSize(desc ocispec.Descriptor) (int, error) {
	s, ok := desc.Annotations[ociimage.AnnotationRawSize]
	if !ok {
		return 0, errcode.New(errcode.InvalidInput, "chunk %s has no %s annotation", desc.Digest, ociimage.AnnotationRawSize)
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n <= 0 || n > ociimage.MaxChunkSize {
		return 0, errcode.New(errcode.InvalidInput, "chunk %s declares raw size %q: want 1..%d", desc.Digest, s, ociimage.MaxChunkSize)
	}
	return int(n), nil
}

// ValidateLayers checks a stream's chunk list before anything is fetched:
// media types, sizes and declared raw sizes. It returns the total raw size.
func ValidateLayers(layers []ocispec.Descriptor) (int64, error) {
	if len(layers) > ociimage.MaxLayers {
		return 0, errcode.New(errcode.InvalidInput, "%d chunks: more than the %d allowed", len(layers), ociimage.MaxLayers)
	}
	var total int64
	for i, l := range layers {
		if l.MediaType != ociimage.MediaTypeChunk {
			return 0, errcode.New(errcode.InvalidInput, "layer %d has media type %q, want %q", i, l.MediaType, ociimage.MediaTypeChunk)
		}
		if l.Size <= 0 || l.Size > ociimage.MaxChunkSize {
			return 0, errcode.New(errcode.InvalidInput, "layer %d declares %d bytes: want 1..%d", i, l.Size, ociimage.MaxChunkSize)
		}
		if err := l.Digest.Validate(); err != nil {
			return 0, errcode.Wrap(errcode.InvalidInput, err, "layer %d", i)
		}
		n, err := rawSize(l)
		if err != nil {
			return 0, err
		}
		if off, ok := l.Annotations[ociimage.AnnotationRawOffset]; ok && off != strconv.FormatInt(total, 10) {
			return 0, errcode.New(errcode.InvalidInput, "layer %d declares offset %s, but the chunks before it add up to %d", i, off, total)
		}
		total += int64(n)
	}
	return total, nil
}

// DecodeStream fetches the chunks, verifies each against its digest before
// using a byte of it, decompresses them concurrently and writes them to w in
// order. Nothing unverified ever reaches w; a bad chunk stops the stream
// with DIGEST_MISMATCH (from the source) or INVALID_INPUT (a chunk that
// decompresses to other than its declared size). Memory is bounded by about
// 2*Workers chunks.
func DecodeStream(ctx context.Context, layers []ocispec.Descriptor, src BlobSource, w io.Writer, opts StreamOptions) (int64, error) {
	opts = opts.withDefaults()
	if _, err := ValidateLayers(layers); err != nil {
		return 0, err
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)

	// One result slot per chunk in the window; the writer takes them in
	// order. The semaphore bounds how far fetching runs ahead of writing.
	type result struct {
		data []byte
		err  error
	}
	slots := make([]chan result, len(layers))
	for i := range slots {
		slots[i] = make(chan result, 1)
	}
	window := make(chan struct{}, 2*opts.Workers)
	next := make(chan int)

	var wg sync.WaitGroup
	for range opts.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dec, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecodeAllCapLimit(true),
				zstd.WithDecoderMaxMemory(ociimage.MaxChunkSize))
			if err != nil {
				cancel(errcode.Wrap(errcode.Internal, err, "zstd decoder"))
				return
			}
			defer dec.Close()
			for i := range next {
				data, err := fetchChunk(ctx, src, dec, layers[i])
				slots[i] <- result{data, err}
			}
		}()
	}
	go func() {
		defer close(next)
		for i := range layers {
			select {
			case window <- struct{}{}:
			case <-ctx.Done():
				return
			}
			select {
			case next <- i:
			case <-ctx.Done():
				return
			}
		}
	}()

	var written int64
	var err error
	for i := range layers {
		var res result
		select {
		case res = <-slots[i]:
		case <-ctx.Done():
			err = context.Cause(ctx)
		}
		if err == nil {
			err = res.err
		}
		if err == nil {
			if _, werr := w.Write(res.data); werr != nil {
				err = errcode.Ensure(errcode.Internal, werr, "writing chunk %d of %d", i+1, len(layers))
			}
		}
		if err != nil {
			break
		}
		written += int64(len(res.data))
		<-window
		if opts.Progress != nil {
			opts.Progress(written)
		}
	}
	// Workers never block on a slot (each has room for its one result), and
	// the feeder gives up on cancellation, so this returns promptly.
	cancel(err)
	wg.Wait()
	return written, err
}

func fetchChunk(ctx context.Context, src BlobSource, dec *zstd.Decoder, desc ocispec.Descriptor) ([]byte, error) {
	want, err := rawSize(desc)
	if err != nil {
		return nil, err
	}
	data, err := src.Blob(ctx, desc, ociimage.MaxChunkSize)
	if err != nil {
		return nil, err
	}
	// The source verifies digests; checking again here costs one hash per
	// chunk and keeps this function safe with any BlobSource.
	if got := digest.NewDigestFromBytes(digest.SHA256, sha256Sum(data)); got != desc.Digest {
		return nil, errcode.New(errcode.DigestMismatch, "chunk %s: content has digest %s", desc.Digest, got)
	}
	out, err := dec.DecodeAll(data, make([]byte, 0, want))
	if err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "chunk %s does not decompress to its declared %d bytes", desc.Digest, want)
	}
	if len(out) != want {
		return nil, errcode.New(errcode.InvalidInput, "chunk %s decompresses to %d bytes, but declares %d", desc.Digest, len(out), want)
	}
	return out, nil
}

// windowFor is the smallest zstd window (a power of two) that covers a chunk.
func windowFor(chunk int) int {
	w := zstd.MinWindowSize
	for w < chunk && w < zstd.MaxWindowSize {
		w *= 2
	}
	return w
}
