// Package chunk is the chunk codec: any byte stream into content-addressed,
// zstd-compressed chunks in an image store, and back (EncodeStream,
// DecodeStream). Cuts are content-defined, between a quarter and 1.5x the
// average. Memory is bounded by two fixed buffer pools. A caller implements
// BlobSink (HasBlob, PutBlob) and BlobSource (Blob, which must verify
// digests); a sink with AddUndigested hashes chunks itself. Not for what the
// bytes are (vmstate, vmstate/disk) or for manifests and tags (ociimage).
package chunk

import (
	"context"
	"crypto/sha256"
	"io"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
)

// BlobSink is where EncodeStream puts compressed chunks. ociimage.Repository
// satisfies it. PutBlob must not keep data once it returns: the buffer is
// reused for the next chunk.
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
	// ChunkSize is the average raw size of a chunk (default 8 MiB), rounded
	// down to a power of two. Chunks are cut where the content says (see
	// chunker), between a quarter and 1.5 times that size.
	ChunkSize int
	// Workers is how many chunks are compressed, fetched or decompressed at
	// once (default 2, whatever the machine: each worker holds up to two
	// chunk buffers, and two compressors at SpeedFastest outrun a registry;
	// see docs/performance.md).
	Workers int
	// Uploads is how many compressed chunks are being stored at once
	// (default 3). Uploads wait on the network and the registry, not on our
	// CPU, so they run beside the compression workers rather than in their
	// place.
	Uploads int
	// Level is the zstd level (default zstd.SpeedFastest, about zstd -1:
	// QEMU's stream is mostly either zero pages, which any level reduces to
	// nothing, or data that barely compresses: on the bench guest's stream
	// 0.4% more bytes than SpeedDefault, for 30% less compression CPU).
	Level zstd.EncoderLevel
	// Progress, if set, is called with the raw bytes done so far, from one
	// goroutine at a time.
	Progress func(rawBytes int64)
	// Fixed makes EncodeStream cut every chunk at exactly ChunkSize
	// (rounded down to a power of two) instead of where the content says:
	// for a file whose bytes sit at fixed offsets (QEMU's mapped-ram
	// format), where a chunk's offset is what makes it match the previous
	// checkpoint's. DecodeStream needs no such option.
	Fixed bool
}

// DefaultWorkers is how many chunks a stream compresses, fetches or
// decompresses at once unless told (StreamOptions.Workers).
const DefaultWorkers = 2

const (
	defaultChunkSize = 8 << 20
	defaultUploads   = 3
	// maxAverageChunk keeps every chunk storable: chunks reach twice the
	// average, and incompressible data grows a little in zstd, so twice
	// this must stay under ociimage.MaxChunkSize with room to spare.
	maxAverageChunk = ociimage.MaxChunkSize / 4
)

// MaxChunkSize is the largest StreamOptions.ChunkSize that is not clamped:
// the agent refuses requests for larger chunks.
const MaxChunkSize = maxAverageChunk

// EffectiveChunkSize is the average chunk size the pipeline uses for a
// requested one: the default for 0, clamped to 4 KiB..maxAverageChunk, and
// rounded down to a power of two.
func EffectiveChunkSize(n int) int {
	if n <= 0 {
		n = defaultChunkSize
	}
	return newChunker(min(n, maxAverageChunk)).avg
}

// WithDefaults fills in what is left zero: the chunk size a run will really
// use (EffectiveChunkSize), the workers, the uploads and the zstd level.
func (o StreamOptions) WithDefaults() StreamOptions {
	o.ChunkSize = EffectiveChunkSize(o.ChunkSize)
	if o.Workers <= 0 {
		o.Workers = DefaultWorkers
	}
	if o.Uploads <= 0 {
		o.Uploads = defaultUploads
	}
	if o.Level == 0 {
		o.Level = zstd.SpeedFastest
	}
	return o
}

// EncodeMemory is what EncodeStream with these options holds at most, in
// bytes: its two buffer pools and its compressors' state. It does not grow
// with the stream.
func (o StreamOptions) EncodeMemory() int64 {
	o = o.WithDefaults()
	ck := newChunker(o.ChunkSize)
	return int64(o.Workers+1)*int64(ck.max) + int64(o.Workers+o.Uploads)*int64(maxEncodedSize(ck.max)) +
		int64(o.Workers)*encoderMemory
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

type uploadJob struct {
	index int
	desc  ocispec.Descriptor
	data  []byte
}

// EncodeStream reads r to its end, cuts it into content-defined chunks,
// compresses and digests each chunk once, concurrently, and stores every
// chunk the sink does not have yet, each at most once.
//
// Three stages run at once: the reader (cutting), Workers compressors and
// Uploads uploaders. Every buffer comes from one of two fixed pools, so
// memory is bounded by (Workers+1) raw and (Workers+Uploads) compressed
// chunks of at most 1.5 times ChunkSize, whatever the stream's size. When the
// sink is slow the uploaders back up, then the compressors, then the
// reader, and so QEMU.
func EncodeStream(ctx context.Context, r io.Reader, sink BlobSink, opts StreamOptions) (StreamResult, error) {
	opts = opts.WithDefaults()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)

	ck := newChunker(opts.ChunkSize)
	if opts.Fixed {
		ck.min, ck.max = ck.avg, ck.avg // cut then returns min(len, avg)
	}
	e := &encodeRun{
		ctx:     ctx,
		cancel:  cancel,
		opts:    opts,
		sink:    sink,
		rawBufs: newBufferPool(opts.Workers+1, ck.max),
		// Sized for the worst case, so that incompressible data never
		// grows a buffer.
		compBufs: newBufferPool(opts.Workers+opts.Uploads, maxEncodedSize(ck.max)),
		jobs:     make(chan chunkJob),
		uploads:  make(chan uploadJob),
		seen:     map[digest.Digest]bool{},
	}
	e.digesting, _ = sink.(undigestedAdder)
	var upWG sync.WaitGroup
	for range opts.Uploads {
		upWG.Add(1)
		go func() {
			defer upWG.Done()
			e.uploader()
		}()
	}
	var wg sync.WaitGroup
	for range opts.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.compressor()
		}()
	}

	raw, readErr := readChunks(ctx, r, ck, e.rawBufs, e.jobs, opts.Progress)
	close(e.jobs)
	wg.Wait()
	close(e.uploads)
	upWG.Wait()

	// A worker's failure (or the caller's cancellation) is the cause; the
	// reader's error is only the symptom then.
	if err := context.Cause(ctx); err != nil {
		if p := e.storeErr.Load(); p != nil && !errcode.Has(err) {
			err = *p
		}
		return StreamResult{}, err
	}
	if readErr != nil {
		return StreamResult{}, readErr
	}
	return StreamResult{Layers: e.layers, RawBytes: raw, StoredBytes: e.stored.Load(), UploadedBytes: e.uploaded.Load()}, nil
}

// readChunks reads r into buffers of ck.max bytes, cuts each chunk where
// the chunker says and hands it to the workers; the bytes after the cut
// start the next buffer. It returns the number of raw bytes read.
func readChunks(ctx context.Context, r io.Reader, ck chunker, bufs *bufferPool, jobs chan<- chunkJob, progress func(int64)) (int64, error) {
	var offset int64
	cur, err := bufs.get(ctx)
	if err != nil {
		return 0, err
	}
	have := 0    // bytes in cur
	eof := false // r is drained: what is left are the bytes in cur
	for index := 0; ; index++ {
		if !eof {
			n, err := io.ReadFull(r, cur[have:])
			have += n
			eof = err == io.EOF || err == io.ErrUnexpectedEOF
			if err != nil && !eof {
				bufs.put(cur)
				return offset, errcode.Ensure(errcode.Internal, err, "reading the state stream")
			}
		}
		if have == 0 {
			bufs.put(cur)
			return offset, nil
		}
		c := ck.cut(cur[:have])
		select {
		case jobs <- chunkJob{index: index, offset: offset, raw: cur[:c]}:
		case <-ctx.Done():
			bufs.put(cur)
			return offset, context.Cause(ctx)
		}
		// The worker reads cur[:c] only, and only this reader takes buffers
		// from the pool, so the bytes after the cut stay put until they are
		// copied to the start of the next buffer. That may be cur itself,
		// when the worker is done with it already (copy allows the overlap):
		// one buffer fewer than getting the next one before the handover.
		next, err := bufs.get(ctx)
		if err != nil {
			return offset, err
		}
		rest := copy(next, cur[c:have])
		offset += int64(c)
		if progress != nil {
			progress(offset)
		}
		cur, have = next, rest
		if eof && have == 0 {
			bufs.put(cur)
			return offset, nil
		}
	}
}

// bufferPool hands out at most n buffers of one size, made on first use,
// and makes get wait while all of them are out: the pools' sizes are the
// pipeline's memory bound.
type bufferPool struct {
	free chan []byte
	size int
}

func newBufferPool(n, size int) *bufferPool {
	p := &bufferPool{free: make(chan []byte, n), size: size}
	for range n {
		p.free <- nil // not made yet
	}
	return p
}

func (p *bufferPool) get(ctx context.Context) ([]byte, error) {
	select {
	case b := <-p.free:
		if b == nil {
			b = make([]byte, p.size)
		}
		return b[:p.size], nil
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
}

func (p *bufferPool) put(b []byte) { p.free <- b[:cap(b)] }

// maxEncodedSize bounds the zstd encoding of n bytes: data that does not
// compress is stored in raw blocks of 128 KiB with a 3-byte header each,
// behind a frame header of at most 18 bytes and a 4-byte checksum.
func maxEncodedSize(n int) int { return n + n>>10 + 4096 }

// blobAdder is a sink that stores a blob unless it has it, and says which,
// in one step (ociimage.Registry: one request for a chunk it has, two for
// one it lacks, where HasBlob and PutBlob would take one and three).
type blobAdder interface {
	AddBlob(ctx context.Context, desc ocispec.Descriptor, data []byte) (sent bool, err error)
}

// undigestedAdder is a sink that digests a blob as it stores it, in the
// same pass as its own work on the bytes (imgcrypt's encrypting store
// hashes the plaintext beside the ciphertext it makes), and returns desc
// with the digest. A blob it has already is not stored again (sent is
// false).
type undigestedAdder interface {
	AddUndigested(ctx context.Context, desc ocispec.Descriptor, data []byte) (stored ocispec.Descriptor, sent bool, err error)
}

// putUndigested is Put for an undigestedAdder.
func putUndigested(ctx context.Context, sink undigestedAdder, desc ocispec.Descriptor, data []byte, uploaded *atomic.Int64) (ocispec.Descriptor, error) {
	desc, sent, err := sink.AddUndigested(ctx, desc, data)
	if err != nil {
		return desc, errcode.Ensure(errcode.RegistryError, err, "storing chunk of %d bytes", len(data))
	}
	if sent {
		uploaded.Add(desc.Size)
	}
	return desc, nil
}

// Put stores a compressed blob in sink unless sink has it already, adding
// its size to uploaded when it was sent. Errors are REGISTRY_ERROR unless
// the store gave a code.
func Put(ctx context.Context, sink BlobSink, desc ocispec.Descriptor, data []byte, uploaded *atomic.Int64) error {
	if a, ok := sink.(blobAdder); ok {
		sent, err := a.AddBlob(ctx, desc, data)
		if err != nil {
			return errcode.Ensure(errcode.RegistryError, err, "storing chunk %s", desc.Digest)
		}
		if sent {
			uploaded.Add(desc.Size)
		}
		return nil
	}
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
	if err := imgcrypt.CheckDecrypted(layers); err != nil {
		return 0, err
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
	opts = opts.WithDefaults()
	if _, err := ValidateLayers(layers); err != nil {
		return 0, err
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)

	d := newDecodeRun(ctx, cancel, layers, src, opts.Workers)
	var wg sync.WaitGroup
	for range opts.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d.decompressor()
		}()
	}
	go d.feed()

	written, err := d.writeInOrder(w, opts.Progress)
	// Workers never block on a slot (each has room for its one result), and
	// the feeder gives up on cancellation, so this returns promptly.
	cancel(err)
	wg.Wait()
	return written, err
}

// fetchChunk fetches a chunk and decompresses it into buf, which holds at
// least its declared raw size.
func fetchChunk(ctx context.Context, src BlobSource, dec *zstd.Decoder, desc ocispec.Descriptor, buf []byte) ([]byte, error) {
	want, err := rawSize(desc)
	if err != nil {
		return nil, err
	}
	data, err := src.Blob(ctx, desc, ociimage.MaxChunkSize)
	if err != nil {
		return nil, err
	}
	// The source has verified the digest (BlobSource's contract; both
	// ociimage stores hash what they read). A second hash here would cost
	// as much CPU as the decompression.
	// The decoder stops at the buffer's capacity (WithDecodeAllCapLimit):
	// a chunk that inflates beyond its declared size fails here.
	out, err := dec.DecodeAll(data, buf[:0:want])
	if err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "chunk %s does not decompress to its declared %d bytes", desc.Digest, want)
	}
	if len(out) != want {
		return nil, errcode.New(errcode.InvalidInput, "chunk %s decompresses to %d bytes, but declares %d", desc.Digest, len(out), want)
	}
	return out, nil
}

// encoderWindow is how far back zstd looks for matches. An encoder keeps
// about twice its window in memory: a window covering a whole chunk (16 MiB
// for 8 MiB chunks) cost 32 MiB per compressor, 1 MiB costs under 3. QEMU's
// stream has nothing to gain from matches further back (an 8 MiB window
// gave the bench guest's stream the same size to the byte). Frames carry no
// xxhash checksum either: every chunk is checked against its sha256 digest
// before a byte of it is decompressed.
const encoderWindow = 1 << 20

// encoderMemory bounds what one compressor keeps besides its input and
// output: its history and tables (measured with encoderWindow: 2.6 MiB at
// SpeedFastest, 3.8 MiB at SpeedDefault; TestEncoderMemory checks it).
const encoderMemory = 4 << 20

// NewEncoder makes the encoder one compression worker uses for all its
// chunks (EncodeAll, in the worker's goroutine).
func NewEncoder(level zstd.EncoderLevel) (*zstd.Encoder, error) {
	return zstd.NewWriter(nil, zstd.WithEncoderLevel(level), zstd.WithEncoderConcurrency(1),
		zstd.WithWindowSize(encoderWindow), zstd.WithEncoderCRC(false))
}

// NewDecoder makes the decoder one worker uses for all its chunks
// (DecodeAll into a buffer of the chunk's declared raw size: it stops at
// the buffer's capacity, so a chunk cannot inflate past what it declares).
func NewDecoder() (*zstd.Decoder, error) {
	return zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecodeAllCapLimit(true),
		zstd.WithDecoderMaxMemory(ociimage.MaxChunkSize))
}
