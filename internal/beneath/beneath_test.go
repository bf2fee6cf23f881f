package beneath

import (
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

// TestOpenStaysBeneath: every way out of the directory, or through a link
// or a mount, fails with the errno callers map to their codes.
func TestOpenStaysBeneath(t *testing.T) {
	root := t.TempDir()
	vol := filepath.Join(root, "vol")
	for _, d := range []string{"vol/sub", "vol/mnt", "other"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write(t, filepath.Join(vol, "sub", "disk"), "mine")
	write(t, filepath.Join(root, "other", "secret"), "not yours")
	os.Symlink("../other/secret", filepath.Join(vol, "up"))
	os.Symlink("sub", filepath.Join(vol, "alias"))
	os.Symlink("/proc/self/root/etc/passwd", filepath.Join(vol, "magic"))
	dir, err := Dir(vol)
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	mounted := false
	if unix.Mount(filepath.Join(root, "other"), filepath.Join(vol, "mnt"), "", unix.MS_BIND, "") == nil {
		mounted = true
		t.Cleanup(func() { unix.Unmount(filepath.Join(vol, "mnt"), unix.MNT_DETACH) })
	}
	for _, tc := range []struct {
		rel  string
		want error
	}{
		{"up", unix.ELOOP},         // a link, out
		{"alias/disk", unix.ELOOP}, // a link, even one that stays inside
		{"magic", unix.ELOOP},      // a link to a magic link
		{"../other/secret", unix.EXDEV},
		{"sub/../../other/secret", unix.EXDEV},
		{"/etc/passwd", unix.EXDEV}, // absolute: not beneath
		{"none", unix.ENOENT},
		{"sub/disk/x", unix.ENOTDIR},
	} {
		f, err := Open(dir, tc.rel, tc.rel)
		if !errors.Is(err, tc.want) {
			t.Errorf("Open(%q) = %v, %v; want %v", tc.rel, f, err, tc.want)
		}
	}
	if mounted {
		if _, err := Open(dir, "mnt/secret", "mnt/secret"); !errors.Is(err, unix.EXDEV) {
			t.Errorf("through a mount point: %v, want EXDEV", err)
		}
	} else {
		t.Log("not root: the mount point case is not checked")
	}
}

// TestReopenReadsWhatWasOpened: the name swapped for another file after
// Open changes nothing for the descriptor.
func TestReopenReadsWhatWasOpened(t *testing.T) {
	vol := t.TempDir()
	write(t, filepath.Join(vol, "disk"), "mine")
	write(t, filepath.Join(vol, "theirs"), "theirs")
	dir, err := Dir(vol)
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	f, err := Open(dir, "disk", "/vm/disk")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if typ, err := Type(f); err != nil || typ != 0 || TypeName(typ) != "a regular file" {
		t.Fatalf("Type = %v, %v", typ, err)
	}
	if err := os.Rename(filepath.Join(vol, "theirs"), filepath.Join(vol, "disk")); err != nil {
		t.Fatal(err)
	}
	r, err := Reopen(f)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if b, _ := io.ReadAll(r); string(b) != "mine" || r.Name() != "/vm/disk" {
		t.Fatalf("read %q from %s, want the file opened", b, r.Name())
	}
	if _, err := r.Write([]byte("x")); err == nil {
		t.Fatal("the reopened file is writable")
	}
	if TypeName(fs.ModeSocket) != "a unix socket" || TypeName(fs.ModeNamedPipe) != "a named pipe" {
		t.Error("TypeName")
	}
}

func write(t *testing.T, path, s string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestOpenMountPointEndsOnWhatIsMounted: unlike Open, the last component
// may be a mount point, and the descriptor is then of the mounted
// directory; links, files and paths of more than one name still fail.
func TestOpenMountPointEndsOnWhatIsMounted(t *testing.T) {
	if os.Geteuid() != 0 {
		guest.SkipOrFail(t, "mount point", "mounting needs root")
	}
	root := t.TempDir()
	for _, d := range []string{"dir/mnt", "other"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write(t, filepath.Join(root, "other", "inside"), "mounted")
	write(t, filepath.Join(root, "dir", "file"), "")
	os.Symlink("mnt", filepath.Join(root, "dir", "link"))
	if err := unix.Mount(filepath.Join(root, "other"), filepath.Join(root, "dir", "mnt"), "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(filepath.Join(root, "dir", "mnt"), unix.MNT_DETACH) })
	dir, err := Dir(filepath.Join(root, "dir"))
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	if _, err := Open(dir, "mnt", "mnt"); !errors.Is(err, unix.EXDEV) {
		t.Fatalf("Open of a mount point: %v, want EXDEV", err)
	}
	m, err := OpenMountPoint(dir, "mnt", "mnt")
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if _, err := Open(m, "inside", "inside"); err != nil {
		t.Fatalf("the descriptor is not of the mounted directory: %v", err)
	}
	for _, tc := range []struct {
		child string
		want  error
	}{{"link", unix.ELOOP}, {"file", unix.ENOTDIR}, {"mnt/..", unix.EINVAL}, {"..", unix.EINVAL}, {"", unix.EINVAL}} {
		if f, err := OpenMountPoint(dir, tc.child, tc.child); !errors.Is(err, tc.want) {
			t.Errorf("OpenMountPoint(%q) = %v, %v; want %v", tc.child, f, err, tc.want)
		}
	}
}
