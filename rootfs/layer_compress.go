package rootfs

import (
	"bufio"
	"context"
	"errors"
	"io"
	"sync"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// layerIOSize is the size of every read from, and write to, containerd's
// content store while a layer is compressed or pushed: each is one gRPC
// round trip, so 32 KiB ones (io.Copy's) are several times slower.
const layerIOSize = 1 << 20

// compressedLayer is what compressLayer wrote.
type compressedLayer struct {
	MediaType string        // ocispec.MediaTypeImageLayerZstd or ...Gzip
	Digest    digest.Digest // of the compressed bytes: the blob's digest
	Size      int64         // compressed bytes written
	DiffID    digest.Digest // of the uncompressed bytes read: the layer's diff ID
	RawSize   int64         // uncompressed bytes read
}

// layerMediaType is the media type of a layer compressed with compression
// (LayerZstd or LayerGzip).
func layerMediaType(compression string) string {
	if compression == LayerGzip {
		return ocispec.MediaTypeImageLayerGzip
	}
	return ocispec.MediaTypeImageLayerZstd
}

// compressLayer reads an uncompressed layer (a tar) from r to its end and
// writes it to w compressed with compression (LayerZstd or LayerGzip), in
// one pass: what it reads is hashed on the way (the diff ID), and so is what
// it writes (the blob's digest). Memory is bounded by the compressor's
// window and two buffers of layerIOSize, whatever the layer's size.
//
// progress, if set, is called with the compressed bytes written to w so far,
// from one goroutine at a time, as they are written; its last call is with
// the total.
//
// Errors: reading r or writing w is INTERNAL (both are containerd's content
// store here), unless ctx ended.
func compressLayer(ctx context.Context, w io.Writer, r io.Reader, compression string, progress func(int64)) (compressedLayer, error) {
	out := &hashingWriter{w: w, h: digest.SHA256.Digester(), progress: progress}
	// The compressor's output goes to w in writes of layerIOSize.
	buffered := bufio.NewWriterSize(out, layerIOSize)
	var zw io.WriteCloser
	abort := func() {}
	switch compression {
	case LayerZstd:
		// zstd's default level and window (8 MiB), compressing one block
		// while the next is read.
		enc, err := zstd.NewWriter(buffered, zstd.WithEncoderLevel(zstd.SpeedDefault))
		if err != nil {
			return compressedLayer{}, errcode.Wrap(errcode.Internal, err, "zstd encoder")
		}
		zw = enc
		abort = func() { enc.Reset(io.Discard); enc.Close() } // stops its goroutines
	case LayerGzip:
		zw = gzip.NewWriter(buffered)
	default:
		return compressedLayer{}, errcode.New(errcode.Usage, "layer compression %q: use %s or %s", compression, LayerZstd, LayerGzip)
	}
	closed := false
	defer func() {
		if !closed {
			abort()
		}
	}()

	raw := digest.SHA256.Digester()
	var rawSize int64
	buf := make([]byte, layerIOSize)
	for {
		if err := ctx.Err(); err != nil {
			return compressedLayer{}, err
		}
		n, rerr := io.ReadFull(r, buf)
		if n > 0 {
			raw.Hash().Write(buf[:n])
			rawSize += int64(n)
			if _, err := zw.Write(buf[:n]); err != nil {
				return compressedLayer{}, writeErr(ctx, err)
			}
		}
		if rerr == io.EOF || rerr == io.ErrUnexpectedEOF {
			break
		}
		if rerr != nil {
			if ctx.Err() != nil {
				return compressedLayer{}, ctx.Err()
			}
			return compressedLayer{}, errcode.Wrap(errcode.Internal, rerr, "reading the uncompressed layer")
		}
	}
	closed = true
	if err := zw.Close(); err != nil {
		return compressedLayer{}, writeErr(ctx, err)
	}
	if err := buffered.Flush(); err != nil {
		return compressedLayer{}, writeErr(ctx, err)
	}
	return compressedLayer{
		MediaType: layerMediaType(compression),
		Digest:    out.h.Digest(),
		Size:      out.n,
		DiffID:    raw.Digest(),
		RawSize:   rawSize,
	}, nil
}

func writeErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return errcode.Wrap(errcode.Internal, err, "writing the compressed layer")
}

// hashingWriter passes writes on to w, hashing and counting them.
type hashingWriter struct {
	w        io.Writer
	h        digest.Digester
	n        int64
	progress func(int64)
}

func (hw *hashingWriter) Write(p []byte) (int, error) {
	n, err := hw.w.Write(p)
	if n > 0 {
		hw.h.Hash().Write(p[:n])
		hw.n += int64(n)
		if hw.progress != nil {
			hw.progress(hw.n)
		}
	}
	return n, err
}

// readAheadReaderAt serves small sequential ReadAt calls (io.Copy's 32 KiB)
// from one read of layerIOSize bytes of ra: each ReadAt of containerd's
// content store is a gRPC call. It is safe for concurrent use.
type readAheadReaderAt struct {
	ra   io.ReaderAt
	size int64

	mu  sync.Mutex
	buf []byte
	off int64 // of buf[0]
}

func newReadAheadReaderAt(ra io.ReaderAt, size int64) *readAheadReaderAt {
	return &readAheadReaderAt{ra: ra, size: size}
}

func (r *readAheadReaderAt) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, errors.New("negative offset")
	}
	if len(p) >= layerIOSize {
		return r.ra.ReadAt(p, off)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for n < len(p) {
		if off >= r.size {
			return n, io.EOF
		}
		if off < r.off || off >= r.off+int64(len(r.buf)) {
			if r.buf == nil {
				r.buf = make([]byte, layerIOSize)
			}
			r.buf = r.buf[:cap(r.buf)]
			want := min(int64(len(r.buf)), r.size-off)
			m, err := r.ra.ReadAt(r.buf[:want], off)
			r.buf, r.off = r.buf[:m], off
			if m < int(want) {
				if err == nil {
					err = io.ErrUnexpectedEOF
				}
				return n + copy(p[n:], r.buf), err // io.EOF: shorter than size
			}
		}
		c := copy(p[n:], r.buf[off-r.off:])
		n += c
		off += int64(c)
	}
	return n, nil
}
