package atomicfile

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// A directory whose filesystem cannot fsync it (procfs answers EINVAL, like
// some FUSE and network filesystems) is synced without error.
func TestSyncDirToleratesEINVAL(t *testing.T) {
	d, err := os.Open("/proc")
	if err != nil {
		t.Skipf("SKIP no /proc: %v", err)
	}
	raw := d.Sync()
	d.Close()
	if !errors.Is(raw, syscall.EINVAL) {
		t.Skipf("SKIP fsync of /proc gives %v here, not EINVAL", raw)
	}
	if err := SyncDir("/proc"); err != nil {
		t.Fatalf("SyncDir(/proc) = %v, want nil: EINVAL means the filesystem cannot sync a directory", err)
	}
}

// Every other failure is returned: a directory that is not there, and a
// path that is not a directory's but whose fsync fails otherwise.
func TestSyncDirReportsOtherErrors(t *testing.T) {
	dir := t.TempDir()
	if err := SyncDir(dir); err != nil {
		t.Fatalf("SyncDir(%s) = %v, want nil", dir, err)
	}
	err := SyncDir(filepath.Join(dir, "gone"))
	if !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("SyncDir(missing) = %v, want a not-exist error", err)
	}
}

// WriteFile puts exactly the data at the path with the mode asked for, and
// leaves no temporary file.
func TestWriteFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "index.json")
	if err := os.WriteFile(path, []byte("old content that is longer"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(path, []byte(`{"a":1}`), 0o644); err != nil {
		t.Fatalf("WriteFile: %v", err)
	}
	got, err := os.ReadFile(path)
	if err != nil || string(got) != `{"a":1}` {
		t.Fatalf("content = %q, %v; want {\"a\":1}", got, err)
	}
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o644 {
		t.Fatalf("mode = %v, want 0644", fi.Mode().Perm())
	}
	if left := leftovers(t, dir); len(left) != 0 {
		t.Fatalf("temporary files left: %v", left)
	}
	if err := WriteFile(filepath.Join(dir, "no", "dir", "f"), []byte("x"), 0o644); err == nil {
		t.Fatal("WriteFile into a missing directory succeeded")
	}
}
