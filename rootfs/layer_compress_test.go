package rootfs

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/errdefs"
	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// layerData is n bytes that look like a layer: runs of random bytes and of
// text, so that the compressed size is neither n nor tiny.
func layerData(n int, seed uint64) []byte {
	rng := rand.New(rand.NewPCG(seed, seed))
	out := make([]byte, 0, n)
	for len(out) < n {
		run := min(n-len(out), 1+rng.IntN(200<<10))
		if rng.IntN(2) == 0 {
			for range run {
				out = append(out, byte(rng.Uint32()))
			}
		} else {
			for len(out) < n && run > 0 {
				line := fmt.Sprintf("%08x level=info msg=%q n=%d\n", len(out), "request served", rng.IntN(1000))
				out = append(out, line[:min(len(line), run, n-len(out))]...)
				run -= len(line)
			}
		}
	}
	return out
}

func decompress(t *testing.T, mediaType string, b []byte) []byte {
	t.Helper()
	var r io.Reader
	switch mediaType {
	case ocispec.MediaTypeImageLayerZstd:
		z, err := zstd.NewReader(bytes.NewReader(b))
		if err != nil {
			t.Fatal(err)
		}
		defer z.Close()
		r = z
	case ocispec.MediaTypeImageLayerGzip:
		g, err := gzip.NewReader(bytes.NewReader(b))
		if err != nil {
			t.Fatal(err)
		}
		r = g
	default:
		t.Fatalf("media type %q", mediaType)
	}
	out, err := io.ReadAll(r)
	if err != nil {
		t.Fatalf("decompressing %s: %v", mediaType, err)
	}
	return out
}

// TestCompressLayer: the output decompresses to the input; Digest and Size
// are the output's, DiffID and RawSize the input's; progress rises to Size.
func TestCompressLayer(t *testing.T) {
	for _, size := range []int{0, 1, layerIOSize - 1, layerIOSize, 5*layerIOSize/2 + 7} {
		in := layerData(size, uint64(size))
		for _, comp := range []string{LayerZstd, LayerGzip} {
			t.Run(fmt.Sprintf("%s/%d", comp, size), func(t *testing.T) {
				var out bytes.Buffer
				var calls []int64
				res, err := compressLayer(context.Background(), &out, bytes.NewReader(in), comp, func(n int64) { calls = append(calls, n) })
				if err != nil {
					t.Fatal(err)
				}
				if want := layerMediaType(comp); res.MediaType != want {
					t.Errorf("media type %s, want %s", res.MediaType, want)
				}
				if res.Digest != digest.FromBytes(out.Bytes()) || res.Size != int64(out.Len()) {
					t.Errorf("blob %s %d bytes, wrote %s %d bytes", res.Digest, res.Size, digest.FromBytes(out.Bytes()), out.Len())
				}
				if want := sha256.Sum256(in); res.DiffID != digest.NewDigestFromBytes(digest.SHA256, want[:]) || res.RawSize != int64(size) {
					t.Errorf("diff ID %s of %d bytes, want %x of %d", res.DiffID, res.RawSize, want, size)
				}
				if got := decompress(t, res.MediaType, out.Bytes()); !bytes.Equal(got, in) {
					t.Errorf("decompressed %d bytes, not the %d written", len(got), len(in))
				}
				if len(calls) == 0 || calls[len(calls)-1] != res.Size {
					t.Fatalf("progress %v, want it to end at %d", calls, res.Size)
				}
				for i := 1; i < len(calls); i++ {
					if calls[i] <= calls[i-1] {
						t.Fatalf("progress not increasing: %v", calls)
					}
				}
				if size > 2*layerIOSize && comp == LayerZstd && len(calls) < 2 {
					t.Errorf("progress called %d times for %d bytes: not as the layer is written", len(calls), res.Size)
				}
			})
		}
	}
}

// TestCompressLayerBoundedMemory streams 192 MiB through compressLayer from
// a reader that allocates nothing: what compressLayer allocates is a small
// fraction of that, so the layer is never held whole.
func TestCompressLayerBoundedMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	const size = 192 << 20
	src := io.LimitReader(&repeatReader{data: layerData(3<<20+1, 9)}, size)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	res, err := compressLayer(context.Background(), io.Discard, src, LayerZstd, nil)
	if err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&after)
	alloc := after.TotalAlloc - before.TotalAlloc
	t.Logf("%d bytes in, %d out, %d MiB allocated", res.RawSize, res.Size, alloc>>20)
	if res.RawSize != size {
		t.Fatalf("read %d bytes, want %d", res.RawSize, size)
	}
	if alloc > size/4 {
		t.Errorf("compressing %d MiB allocated %d MiB: the layer is buffered, not streamed", size>>20, alloc>>20)
	}
}

// repeatReader repeats data forever.
type repeatReader struct {
	data []byte
	off  int
}

func (r *repeatReader) Read(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		c := copy(p[n:], r.data[r.off:])
		r.off = (r.off + c) % len(r.data)
		n += c
	}
	return n, nil
}

type brokenWriter struct{ after int }

func (w *brokenWriter) Write(p []byte) (int, error) {
	if w.after < len(p) {
		return 0, errors.New("disk full")
	}
	w.after -= len(p)
	return len(p), nil
}

type brokenReader struct {
	r   io.Reader
	err error
}

func (f *brokenReader) Read(p []byte) (int, error) {
	n, err := f.r.Read(p)
	if err == io.EOF {
		return n, f.err
	}
	return n, err
}

func TestCompressLayerErrors(t *testing.T) {
	in := layerData(3*layerIOSize, 7)
	ctx := context.Background()
	for _, comp := range []string{LayerZstd, LayerGzip} {
		_, err := compressLayer(ctx, io.Discard, &brokenReader{bytes.NewReader(in), errors.New("connection reset")}, comp, nil)
		if !errcode.Is(err, errcode.Internal) {
			t.Errorf("%s, reader fails: %v (%s), want INTERNAL", comp, err, errcode.Of(err))
		}
		_, err = compressLayer(ctx, &brokenWriter{after: layerIOSize}, bytes.NewReader(in), comp, nil)
		if !errcode.Is(err, errcode.Internal) {
			t.Errorf("%s, writer fails: %v (%s), want INTERNAL", comp, err, errcode.Of(err))
		}
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		if _, err = compressLayer(cctx, io.Discard, bytes.NewReader(in), comp, nil); !errors.Is(err, context.Canceled) {
			t.Errorf("%s, canceled: %v", comp, err)
		}
	}
	if _, err := compressLayer(ctx, io.Discard, bytes.NewReader(in), "lz4", nil); !errcode.Is(err, errcode.Usage) {
		t.Errorf("lz4: %v, want USAGE", err)
	}
}

// countingReaderAt counts the ReadAt calls that reach it.
type countingReaderAt struct {
	r     *bytes.Reader
	calls atomic.Int64
}

func (c *countingReaderAt) ReadAt(p []byte, off int64) (int, error) {
	c.calls.Add(1)
	return c.r.ReadAt(p, off)
}

// TestReadAheadReaderAt: io.Copy's small reads reach the source as a few
// reads of layerIOSize; the bytes are the source's, concurrent readers
// included; a source shorter than its size ends in io.EOF.
func TestReadAheadReaderAt(t *testing.T) {
	data := layerData(3*layerIOSize+12345, 3)
	src := &countingReaderAt{r: bytes.NewReader(data)}
	ra := newReadAheadReaderAt(src, int64(len(data)))
	var out bytes.Buffer
	// One byte more than the size, as ociimage's PutBlobStream reads.
	n, err := io.Copy(&out, io.NewSectionReader(ra, 0, int64(len(data))+1))
	if err != nil || n != int64(len(data)) || !bytes.Equal(out.Bytes(), data) {
		t.Fatalf("copied %d bytes (%v), equal %v", n, err, bytes.Equal(out.Bytes(), data))
	}
	if c := src.calls.Load(); c > int64(len(data)/layerIOSize+1) {
		t.Errorf("%d reads of the source for %d bytes", c, len(data))
	}

	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			off := int64(i * 777777)
			got := make([]byte, 40000)
			for ; off < int64(len(data)); off += int64(len(got)) {
				n, err := ra.ReadAt(got, off)
				if want := data[off:min(off+int64(len(got)), int64(len(data)))]; !bytes.Equal(got[:n], want) || (err != nil && err != io.EOF) {
					t.Errorf("ReadAt(%d): %d bytes, %v", off, n, err)
					return
				}
			}
		}()
	}
	wg.Wait()

	short := newReadAheadReaderAt(bytes.NewReader(data[:1000]), 5000)
	p := make([]byte, 3000)
	if n, err := short.ReadAt(p, 0); n != 1000 || err != io.EOF {
		t.Errorf("short source: %d bytes, %v; want 1000, EOF", n, err)
	}
}

// BenchmarkCompressLayer is compressLayer alone, on 32 MiB of layerData.
func BenchmarkCompressLayer(b *testing.B) {
	in := layerData(32<<20, 5)
	for _, comp := range []string{LayerZstd, LayerGzip} {
		b.Run(comp, func(b *testing.B) {
			b.SetBytes(int64(len(in)))
			var res compressedLayer
			for b.Loop() {
				var err error
				if res, err = compressLayer(context.Background(), io.Discard, bytes.NewReader(in), comp, nil); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(res.RawSize)/float64(res.Size), "ratio")
		})
	}
}

// labelStore is the part of a content store scratch uses: blobs and their
// labels.
type labelStore struct {
	content.Store // nil: any other method panics
	blobs         map[digest.Digest]map[string]string
	deleted       []digest.Digest
}

func (s *labelStore) Info(_ context.Context, d digest.Digest) (content.Info, error) {
	l, ok := s.blobs[d]
	if !ok {
		return content.Info{}, errdefs.ErrNotFound
	}
	return content.Info{Digest: d, Labels: l}, nil
}

func (s *labelStore) Delete(_ context.Context, d digest.Digest) error {
	delete(s.blobs, d)
	s.deleted = append(s.deleted, d)
	return nil
}

// TestScratchDeletesOnlyItsOwn: a blob the capture's differ or writer found
// already there (same bytes, another image's) has no label of this capture
// and is never deleted.
func TestScratchDeletesOnlyItsOwn(t *testing.T) {
	ours, theirs, other, gone := digest.FromString("ours"), digest.FromString("theirs"), digest.FromString("other capture"), digest.FromString("gone")
	cs := &labelStore{blobs: map[digest.Digest]map[string]string{
		ours:   {scratchLabel: "t1", "containerd.io/uncompressed": "sha256:..."},
		theirs: {"containerd.io/gc.ref.content": "x"},
		other:  {scratchLabel: "t2"},
	}}
	s := &scratch{cs: cs, token: "t1"}
	for _, d := range []digest.Digest{ours, theirs, other, gone} {
		s.add(d)
	}
	s.cleanup(context.Background())
	if len(cs.deleted) != 1 || cs.deleted[0] != ours || len(cs.blobs) != 2 {
		t.Errorf("deleted %v, left %v; want only %s deleted", cs.deleted, cs.blobs, ours)
	}
	if len(s.digests) != 0 {
		t.Errorf("scratch still lists %v", s.digests)
	}
}
