package ramfile

import (
	"context"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// BenchmarkScan scans a 1 GiB RAM file on /dev/shm whose pages are all
// allocated (a guest that has touched all its memory, or one a stream
// checkpoint read through), 256 MiB of it random data: what a memory-file
// checkpoint does while the VM is stopped. As a base, and as a delta of an
// unchanged file on a parent the node recorded (its map taken as is) and
// on one it did not (every page the map vouches for hashed with SHA-256):
// compare their ns/op for what verifying a parent costs in downtime.
func BenchmarkScan(b *testing.B) {
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
	for _, tc := range []struct {
		name    string
		parent  *Parent
		changed int
	}{
		{"base", nil, data / PageSize},
		{"recorded-parent", &Parent{Map: base.Map}, 0},
		{"verified-parent", &Parent{Map: base.Map, Verify: true}, 0},
	} {
		b.Run(tc.name, func(b *testing.B) {
			b.SetBytes(size)
			for b.Loop() {
				c, err := Scan(f, size, tc.parent, "/dev/shm")
				if err != nil {
					b.Fatal(err)
				}
				if c.Changed() != tc.changed {
					b.Fatalf("%d changed pages, want %d", c.Changed(), tc.changed)
				}
				c.Close()
			}
		})
	}
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
