package atomicfile

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// smallFS mounts a tmpfs of size bytes (it needs root).
func smallFS(t *testing.T, size string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("SKIP mounting a tmpfs needs root")
	}
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size="+size); err != nil {
		t.Skipf("SKIP cannot mount a tmpfs: %v", err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(dir, syscall.MNT_DETACH) })
	return dir
}

// A full disk fails the write with the full-disk code and a message that
// names the file and says what to do, and leaves the old file and nothing
// else behind.
func TestAtomicFileFullDisk(t *testing.T) {
	dir := smallFS(t, "256k")
	path := filepath.Join(dir, "overlay.qcow2")
	if err := os.WriteFile(path, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := Create(path, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Abort()
	_, werr := f.Write(bytes.Repeat([]byte{0xa5}, 1<<20))
	cerr := f.Commit()
	for name, err := range map[string]error{"Write": werr, "Commit": cerr} {
		if errcode.Of(err) != errcode.NoSpace {
			t.Errorf("%s: %v (%s), want %s", name, err, errcode.Of(err), errcode.NoSpace)
			continue
		}
		for _, want := range []string{"writing " + path, "no space left on device", "the filesystem holding " + dir + " is full: free space there"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s: %q does not say %q", name, err, want)
			}
		}
	}
	if b, err := os.ReadFile(path); err != nil || string(b) != "old" {
		t.Fatalf("the old file is %q, %v", b, err)
	}
	if tmp := leftovers(t, dir); len(tmp) > 0 {
		t.Fatalf("temporary files left: %v", tmp)
	}
}
