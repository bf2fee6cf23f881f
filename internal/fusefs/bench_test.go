package fusefs

import (
	"os"
	"testing"
)

// BenchmarkColdRead reads a 4 MiB file whose pages the kernel does not hold:
// through the mount (every page a READ to this server, which reads the
// backing file) and, as the baseline in the same run, the backing file
// itself from the page cache. The ratio is the server's cost per byte.
//
//	go test -run '^$' -bench ColdRead -count 5 ./internal/fusefs
func BenchmarkColdRead(b *testing.B) {
	tree, _ := newTestTree(b)
	m := mountTree(b, tree, nil)
	buf := make([]byte, fileSize)
	read := func(b *testing.B, path string) {
		f, err := os.Open(path)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		if _, err := f.ReadAt(buf, 0); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("mount", func(b *testing.B) {
		b.SetBytes(fileSize)
		for b.Loop() {
			if err := m.conn.InvalidateInode(nodeRAM, 0, 0); err != nil {
				b.Fatal(err)
			}
			read(b, m.file("ram"))
		}
	})
	b.Run("backing", func(b *testing.B) {
		b.SetBytes(fileSize)
		for b.Loop() {
			read(b, tree.ram.Name())
		}
	})
}
