package ramfile

import (
	"context"
	"testing"
)

// BenchmarkStore stores the 256 MiB of random data of BenchmarkScan's
// 1 GiB file (as a base) into a sink that keeps nothing: what a
// memory-file checkpoint does after the VM runs again, without the
// store's own cost.
func BenchmarkStore(b *testing.B) {
	const size, data = 1 << 30, 256 << 20
	f := benchRAMFile(b, size, data)
	c, err := Scan(f, size, nil, "/dev/shm")
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	b.SetBytes(data)
	for b.Loop() {
		st, err := c.Store(context.Background(), discard{}, StoreOptions{})
		if err != nil {
			b.Fatal(err)
		}
		if st.StoredBytes < data {
			b.Fatalf("stored %d bytes of %d of random data", st.StoredBytes, data)
		}
	}
}
