package qmptest

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// MapFile maps the file at path into this process, shared and read-only,
// until t ends: a FakeQEMU runs in the test's process, and a real QEMU
// maps its RAM file, which vmsnap checks (/proc/PID/maps) before it reads
// a file QEMU names.
func MapFile(t testing.TB, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	b, err := unix.Mmap(int(f.Fd()), 0, int(max(fi.Size(), 1)), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(b) })
}
