package ramfile

import (
	"math/rand/v2"
	"os"
	"testing"
)

// BenchmarkScan scans a 1 GiB RAM file on /dev/shm whose pages are all
// allocated (a guest that has touched all its memory, or one a stream
// checkpoint read through), 256 MiB of it random data: what a memory-file
// checkpoint does while the VM is stopped.
func BenchmarkScan(b *testing.B) {
	const size, data = 1 << 30, 256 << 20
	if fi, err := os.Stat("/dev/shm"); err != nil || !fi.IsDir() {
		b.Skip("no /dev/shm")
	}
	f, err := os.CreateTemp("/dev/shm", "vmsnap-scan-bench-")
	if err != nil {
		b.Fatal(err)
	}
	defer os.Remove(f.Name())
	defer f.Close()
	zero := make([]byte, 4<<20)
	for off := int64(0); off < size; off += int64(len(zero)) {
		if _, err := f.WriteAt(zero, off); err != nil {
			b.Fatal(err)
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 64<<10)
	// 256 MiB of random data in 64 KiB runs spread over the file.
	for i := int64(0); i < data/int64(len(buf)); i++ {
		for j := range buf {
			buf[j] = byte(rng.Uint32())
		}
		if _, err := f.WriteAt(buf, i*4*int64(len(buf))); err != nil {
			b.Fatal(err)
		}
	}
	b.SetBytes(size)
	b.ResetTimer()
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
