package chunk

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"runtime"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
	"github.com/vmsnap/vmsnap/ociimage"
)

func TestStreamRoundTrip(t *testing.T) {
	data := chunkdata.Stream(t, 5<<20+12345)
	for _, tc := range []struct{ chunk, workers int }{{1 << 20, 1}, {1 << 20, 4}, {64 << 10, 3}, {8 << 20, 2}} {
		t.Run(strconv.Itoa(tc.chunk)+"x"+strconv.Itoa(tc.workers), func(t *testing.T) {
			store := chunkdata.NewStore()
			opts := StreamOptions{ChunkSize: tc.chunk, Workers: tc.workers}
			res, err := EncodeStream(context.Background(), bytes.NewReader(data), store, opts)
			if err != nil {
				t.Fatal(err)
			}
			if res.RawBytes != int64(len(data)) {
				t.Fatalf("read %d bytes of %d", res.RawBytes, len(data))
			}
			// Every chunk but the last is between min and max (a quarter and 1.5 times the
			// average).
			ck := newChunker(tc.chunk)
			for i, l := range res.Layers {
				n, _ := strconv.Atoi(l.Annotations[ociimage.AnnotationRawSize])
				if n > ck.max || n < ck.min && i < len(res.Layers)-1 {
					t.Fatalf("chunk %d of %d holds %d bytes; want %d..%d", i, len(res.Layers), n, ck.min, ck.max)
				}
			}
			// Uploaded may be less than stored: identical chunks within one
			// stream are stored once.
			if res.StoredBytes >= res.RawBytes || res.UploadedBytes <= 0 || res.UploadedBytes > res.StoredBytes {
				t.Fatalf("stored %d uploaded %d of raw %d: compression or accounting is off", res.StoredBytes, res.UploadedBytes, res.RawBytes)
			}
			total, err := ValidateLayers(res.Layers)
			if err != nil || total != int64(len(data)) {
				t.Fatalf("ValidateLayers = %d, %v", total, err)
			}
			var out bytes.Buffer
			n, err := DecodeStream(context.Background(), res.Layers, store, &out, opts)
			if err != nil {
				t.Fatal(err)
			}
			if n != int64(len(data)) || !bytes.Equal(out.Bytes(), data) {
				t.Fatalf("round trip differs: %d bytes back of %d", n, len(data))
			}
		})
	}
}

// TestStreamDedup changes a stream the ways a VM's memory changes between
// two checkpoints: bytes rewritten in place, and bytes inserted or removed
// (a zero page that became data, or went back to zero, changes the
// stream's length). Chunks are content-defined, so only the chunks around
// the change are new; the rest are found in the store. Fixed-size chunks
// would upload everything after an insertion again.
func TestStreamDedup(t *testing.T) {
	const chunk = 256 << 10
	base := chunkdata.Random(5, 8<<20) // seeded: the cut points are the same every run
	mid := len(base) / 2
	insert := chunkdata.Random(6, 4096)
	for _, tc := range []struct {
		name   string
		change func([]byte) []byte
		// most is the most the second stream may upload. A rewrite touches
		// one chunk, two if it moved a boundary. An insertion or removal
		// touches the chunk around it and the chunks cut by length after
		// it, until a cut placed by content resynchronizes: one in five
		// chunks ends at max, so a few at most.
		most int64
		// fixedMore: fixed-size chunks would upload everything after the
		// change again.
		fixedMore bool
	}{
		{"one byte rewritten", func(b []byte) []byte { b = bytes.Clone(b); b[mid] ^= 0xff; return b }, 2 * (chunk*3/2 + 1024), false},
		{"4 KiB inserted", func(b []byte) []byte { return slices.Concat(b[:mid], insert, b[mid:]) }, int64(len(base) / 5), true},
		{"4 KiB removed", func(b []byte) []byte { return slices.Concat(b[:mid], b[mid+4096:]) }, int64(len(base) / 5), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			second := func(opts StreamOptions) StreamResult {
				store := chunkdata.NewStore()
				if _, err := EncodeStream(context.Background(), bytes.NewReader(base), store, opts); err != nil {
					t.Fatal(err)
				}
				changed := tc.change(base)
				res, err := EncodeStream(context.Background(), bytes.NewReader(changed), store, opts)
				if err != nil {
					t.Fatal(err)
				}
				var out bytes.Buffer
				if _, err := DecodeStream(context.Background(), res.Layers, store, &out, opts); err != nil || !bytes.Equal(out.Bytes(), changed) {
					t.Fatalf("round trip of the changed stream: %v", err)
				}
				return res
			}
			cdc := second(StreamOptions{ChunkSize: chunk})
			if cdc.UploadedBytes <= 0 || cdc.UploadedBytes > tc.most {
				t.Fatalf("second stream uploaded %d bytes of %d; want at most %d", cdc.UploadedBytes, cdc.StoredBytes, tc.most)
			}
			if !tc.fixedMore {
				return
			}
			fixed := second(StreamOptions{ChunkSize: chunk, Fixed: true})
			if fixed.UploadedBytes < int64(len(base)*2/5) {
				t.Fatalf("with fixed-size chunks the second stream uploaded only %d bytes of %d: the change no longer shifts the chunks after it, and this test shows nothing", fixed.UploadedBytes, fixed.StoredBytes)
			}
			t.Logf("uploaded after the change: %d KiB with content-defined chunks, %d KiB with fixed-size ones", cdc.UploadedBytes>>10, fixed.UploadedBytes>>10)
		})
	}
}

func TestDecodeRefusesCorruptChunkBeforeWritingIt(t *testing.T) {
	data := chunkdata.Stream(t, 4<<20)
	store := chunkdata.NewStore()
	opts := StreamOptions{ChunkSize: 256 << 10, Workers: 3}
	res, err := EncodeStream(context.Background(), bytes.NewReader(data), store, opts)
	if err != nil {
		t.Fatal(err)
	}
	// A chunk whose content occurs once: the zeros in the middle of the
	// stream make identical chunks, stored once.
	count := map[digest.Digest]int{}
	for _, l := range res.Layers {
		count[l.Digest]++
	}
	bad := len(res.Layers) / 2
	for count[res.Layers[bad].Digest] > 1 {
		bad++
	}
	var want int64
	for _, l := range res.Layers[:bad] {
		n, _ := strconv.Atoi(l.Annotations[ociimage.AnnotationRawSize])
		want += int64(n)
	}
	store.Blobs[res.Layers[bad].Digest][10] ^= 1
	var out bytes.Buffer
	n, err := DecodeStream(context.Background(), res.Layers, store, &out, opts)
	if errcode.Of(err) != errcode.DigestMismatch {
		t.Fatalf("err = %v, want DIGEST_MISMATCH", err)
	}
	if n != want || int64(out.Len()) != want {
		t.Fatalf("wrote %d bytes (%d reported) before the bad chunk, want exactly the %d verified ones", out.Len(), n, want)
	}
	if !bytes.Equal(out.Bytes(), data[:out.Len()]) {
		t.Fatal("the verified prefix differs from the original")
	}
}

func TestDecodeRefusesLyingRawSize(t *testing.T) {
	data := chunkdata.Stream(t, 1<<20)
	store := chunkdata.NewStore()
	res, err := EncodeStream(context.Background(), bytes.NewReader(data), store, StreamOptions{ChunkSize: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	for _, declared := range []string{"1000", strconv.Itoa(512 << 10)} {
		layers := cloneLayers(res.Layers)
		layers[1].Annotations[ociimage.AnnotationRawSize] = declared
		delete(layers[2].Annotations, ociimage.AnnotationRawOffset) // offsets would catch it first
		delete(layers[3].Annotations, ociimage.AnnotationRawOffset)
		_, err := DecodeStream(context.Background(), layers, store, io.Discard, StreamOptions{})
		if errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("declared %s: err = %v, want INVALID_INPUT", declared, err)
		}
	}
}

func TestValidateLayersRefusesBadManifests(t *testing.T) {
	good := ocispec.Descriptor{
		MediaType: ociimage.MediaTypeChunk, Digest: digest.FromString("x"), Size: 10,
		Annotations: map[string]string{ociimage.AnnotationRawSize: "100", ociimage.AnnotationRawOffset: "0"},
	}
	mut := func(f func(d *ocispec.Descriptor)) []ocispec.Descriptor {
		d := cloneLayers([]ocispec.Descriptor{good})[0]
		f(&d)
		return []ocispec.Descriptor{d}
	}
	cases := map[string][]ocispec.Descriptor{
		"media type":    mut(func(d *ocispec.Descriptor) { d.MediaType = "application/vnd.oci.image.layer.v1.tar" }),
		"negative size": mut(func(d *ocispec.Descriptor) { d.Size = -1 }),
		"huge size":     mut(func(d *ocispec.Descriptor) { d.Size = 1 << 40 }),
		"bad digest":    mut(func(d *ocispec.Descriptor) { d.Digest = "sha256:nothex" }),
		"no raw size":   mut(func(d *ocispec.Descriptor) { delete(d.Annotations, ociimage.AnnotationRawSize) }),
		"huge raw size": mut(func(d *ocispec.Descriptor) { d.Annotations[ociimage.AnnotationRawSize] = "99999999999" }),
		"zero raw size": mut(func(d *ocispec.Descriptor) { d.Annotations[ociimage.AnnotationRawSize] = "0" }),
		"wrong offset":  mut(func(d *ocispec.Descriptor) { d.Annotations[ociimage.AnnotationRawOffset] = "7" }),
		"text raw size": mut(func(d *ocispec.Descriptor) { d.Annotations[ociimage.AnnotationRawSize] = "ten" }),
	}
	for name, layers := range cases {
		if _, err := ValidateLayers(layers); errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("%s: err = %v, want INVALID_INPUT", name, err)
		}
	}
	if n, err := ValidateLayers([]ocispec.Descriptor{good}); err != nil || n != 100 {
		t.Fatalf("good layer: %d, %v", n, err)
	}
}

func TestEncodeStopsOnSinkFailure(t *testing.T) {
	store := chunkdata.NewStore()
	var n atomic.Int32
	boom := errors.New("disk full")
	store.PutHook = func() error {
		if n.Add(1) == 3 {
			return boom
		}
		return nil
	}
	_, err := EncodeStream(context.Background(), bytes.NewReader(chunkdata.Stream(t, 4<<20)), store, StreamOptions{ChunkSize: 256 << 10})
	if !errors.Is(err, boom) || errcode.Of(err) != errcode.RegistryError {
		t.Fatalf("err = %v, want the sink's error as REGISTRY_ERROR", err)
	}
}

// countingReader counts what has been read from it, for back-pressure.
type countingReader struct {
	r io.Reader
	n atomic.Int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n.Add(int64(n))
	return n, err
}

// A stalled store must stall the reader (and so QEMU) instead of letting
// chunks pile up in memory.
func TestEncodeBackPressure(t *testing.T) {
	const chunk, workers = 64 << 10, 2
	store := chunkdata.NewStore()
	release := make(chan struct{})
	store.PutHook = func() error { <-release; return nil }
	src := &countingReader{r: bytes.NewReader(chunkdata.Stream(t, 8<<20))}
	done := make(chan error, 1)
	go func() {
		_, err := EncodeStream(context.Background(), src, store, StreamOptions{ChunkSize: chunk, Workers: workers})
		done <- err
	}()
	time.Sleep(300 * time.Millisecond)
	// Raw chunks (at most twice the average): one per worker, `workers`
	// queued, the reader's; compressed ones (no smaller, the data is
	// random) in the workers and the stalled uploaders. The reader may be
	// one buffer ahead.
	uploads := StreamOptions{}.WithDefaults().Uploads
	if got, limit := src.n.Load(), int64((2*workers+1+uploads+1)*2*chunk); got > limit {
		t.Fatalf("read %d bytes while the store was stalled; the bound is %d", got, limit)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if src.n.Load() != 8<<20 {
		t.Fatalf("read %d bytes after release, want all", src.n.Load())
	}
}

func TestEncodeHonoursCancellation(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		_, err := EncodeStream(ctx, pr, chunkdata.NewStore(), StreamOptions{ChunkSize: 64 << 10})
		done <- err
	}()
	go func() { _, _ = pw.Write(make([]byte, 200<<10)) }()
	time.Sleep(100 * time.Millisecond)
	cancel()
	pw.CloseWithError(context.Canceled) // what closing the pipe does in Checkpoint
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("err = %v, want context.Canceled", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("EncodeStream did not return after cancellation")
	}
}

func cloneLayers(in []ocispec.Descriptor) []ocispec.Descriptor {
	out := make([]ocispec.Descriptor, len(in))
	for i, d := range in {
		out[i] = d
		out[i].Annotations = map[string]string{}
		for k, v := range d.Annotations {
			out[i].Annotations[k] = v
		}
	}
	return out
}

// discardSink stores nothing and has nothing, like an empty remote store
// with infinite bandwidth.
type discardSink struct{}

func (discardSink) HasBlob(context.Context, digest.Digest) (bool, error) { return false, nil }
func (discardSink) PutBlob(context.Context, ocispec.Descriptor, []byte) error {
	return nil
}

// The compression buffers are sized once for the worst case: incompressible
// data must fit without growing them.
func TestMaxEncodedSizeHoldsIncompressibleData(t *testing.T) {
	for _, n := range []int{1, 4095, 128 << 10, 1<<20 + 7, 4 << 20} {
		data := make([]byte, n)
		rand.Read(data)
		enc, err := NewEncoder(StreamOptions{}.WithDefaults().Level)
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 0, maxEncodedSize(n))
		out := enc.EncodeAll(data, buf)
		enc.Close()
		if len(out) > cap(buf) || &out[:1][0] != &buf[:1][0] {
			t.Fatalf("%d random bytes encode to %d, more than the %d reserved", n, len(out), cap(buf))
		}
	}
}

// A compressor's own state stays within encoderMemory at every level
// EncodeStream may use, whatever the chunk size: EncodeMemory, and so the
// agent's memory, rests on it.
func TestEncoderMemory(t *testing.T) {
	data := make([]byte, 12<<20) // a 1.5 x 8 MiB chunk: half random, half zero
	rand.Read(data[:len(data)/2])
	out := make([]byte, 0, maxEncodedSize(len(data)))
	for _, level := range []zstd.EncoderLevel{zstd.SpeedFastest, zstd.SpeedDefault} {
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		enc, err := NewEncoder(level)
		if err != nil {
			t.Fatal(err)
		}
		for range 3 {
			out = enc.EncodeAll(data, out[:0])
		}
		runtime.ReadMemStats(&after)
		grew := int64(after.HeapAlloc) - int64(before.HeapAlloc)
		t.Logf("%v: encoder state %d KiB", level, grew>>10)
		if grew > encoderMemory {
			t.Errorf("%v: the encoder holds %d KiB, more than the %d KiB encoderMemory allows", level, grew>>10, encoderMemory>>10)
		}
		runtime.KeepAlive(enc)
		enc.Close()
	}
}
