package ramfile

import (
	"context"
	"math/rand/v2"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// BenchmarkScan scans a 1 GiB RAM file on /dev/shm whose pages are all
// allocated (a guest that has touched all its memory, or one a stream
// checkpoint read through), 256 MiB of it random data: what a memory-file
// checkpoint does while the VM is stopped.
func BenchmarkScan(b *testing.B) {
	const size, data = 1 << 30, 256 << 20
	f := benchRAMFile(b, size, data)
	b.SetBytes(size)
	for b.Loop() {
		c, err := Scan(f, size, nil, "/dev/shm")
		if err != nil {
			b.Fatal(err)
		}
		if c.Changed() != data/PageSize {
			b.Fatalf("%d changed pages, want %d", c.Changed(), data/PageSize)
		}
		c.Close()
	}
}

// BenchmarkScanParentTrust is what verifying a parent the node did not
// record costs the stopped VM: pairs of scans of the 1 GiB file above, as
// a delta of the unchanged file on a recorded parent (its map taken as is)
// and on the same map to verify (each page it vouches for hashed with
// SHA-256), back to back, in alternating order; the median of the pairs'
// ratios, verified over recorded (and over a base's scan).
func BenchmarkScanParentTrust(b *testing.B) {
	const size, data = 1 << 30, 256 << 20
	f := benchRAMFile(b, size, data)
	base, err := Scan(f, size, nil, "/dev/shm")
	if err != nil {
		b.Fatal(err)
	}
	if _, err := base.Store(context.Background(), discard{}, StoreOptions{}); err != nil {
		b.Fatal(err)
	}
	base.Close()
	scan := func(p *Parent) time.Duration {
		b.Helper()
		start := time.Now()
		c, err := Scan(f, size, p, "/dev/shm")
		if err != nil {
			b.Fatal(err)
		}
		c.Close()
		return time.Since(start)
	}
	recorded, verified := &Parent{Map: base.Map}, &Parent{Map: base.Map, Verify: true}
	var overRecorded, overBase []float64
	i := 0
	for b.Loop() {
		var r, v, n time.Duration
		if i%2 == 0 {
			r, v, n = scan(recorded), scan(verified), scan(nil)
		} else {
			n, v, r = scan(nil), scan(verified), scan(recorded)
		}
		overRecorded, overBase = append(overRecorded, float64(v)/float64(r)), append(overBase, float64(v)/float64(n))
		i++
	}
	b.ReportMetric(median(overRecorded), "verified/recorded")
	b.ReportMetric(median(overBase), "verified/base")
}

func median(v []float64) float64 {
	v = slices.Clone(v)
	slices.Sort(v)
	return v[len(v)/2]
}

// benchRAMFile is a RAM file on /dev/shm of size bytes, all allocated,
// with data bytes of random data in 64 KiB runs spread over it.
func benchRAMFile(b *testing.B, size, data int64) *os.File {
	if fi, err := os.Stat("/dev/shm"); err != nil || !fi.IsDir() {
		b.Skip("no /dev/shm")
	}
	f, err := os.CreateTemp("/dev/shm", "vmsnap-scan-bench-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		f.Close()
		os.Remove(f.Name())
	})
	zero := make([]byte, 4<<20)
	for off := int64(0); off < size; off += int64(len(zero)) {
		if _, err := f.WriteAt(zero, off); err != nil {
			b.Fatal(err)
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 64<<10)
	for i := int64(0); i < data/int64(len(buf)); i++ {
		for j := range buf {
			buf[j] = byte(rng.Uint32())
		}
		if _, err := f.WriteAt(buf, i*4*int64(len(buf))); err != nil {
			b.Fatal(err)
		}
	}
	return f
}

// discard is a store that keeps nothing.
type discard struct{}

func (discard) HasBlob(context.Context, digest.Digest) (bool, error)      { return false, nil }
func (discard) PutBlob(context.Context, ocispec.Descriptor, []byte) error { return nil }
