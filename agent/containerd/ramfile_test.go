package containerd

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// The mem-path a memory-file checkpoint reads comes from the VM's QEMU,
// which the tenant controls: it may name any path. openRAMFile opens it
// only as a regular file on a volume of the VM's own pod, read-only, the
// way the disk is opened; everything else is refused before a byte is
// read. Real files, real openat2.
func TestOpenRAMFileOnlyOnThePodsOwnVolume(t *testing.T) {
	podsDir := t.TempDir()
	uid, otherUID := "3f2c1a9e-8b7d-4c6e-9f10-2a3b4c5d6e7f", "0f2c1a9e-8b7d-4c6e-9f10-2a3b4c5d6e70"
	vol := func(uid, name string) string {
		d := filepath.Join(podsDir, uid, "volumes", "kubernetes.io~empty-dir", name)
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		return d
	}
	ram, otherRAM := vol(uid, "ram"), vol(otherUID, "ram")
	guest := bytes.Repeat([]byte("the guest's own RAM "), 1000)
	if err := os.WriteFile(filepath.Join(ram, "guest.ram"), guest, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(otherRAM, "guest.ram"), []byte("ANOTHER TENANT'S RAM"), 0o600); err != nil {
		t.Fatal(err)
	}
	nodeDir := t.TempDir()
	if err := os.WriteFile(filepath.Join(nodeDir, "secret"), []byte("THE NODE'S SECRET"), 0o600); err != nil {
		t.Fatal(err)
	}
	// Inside the pod's own volume: a link to the other pod's file, a link
	// to a node file, a FIFO (opening it for reading would block), a
	// directory, and a directory with another pod's volume mounted on it.
	if err := os.Symlink(filepath.Join(otherRAM, "guest.ram"), filepath.Join(ram, "link.ram")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc/passwd", filepath.Join(ram, "passwd")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(otherRAM, filepath.Join(ram, "dirlink")); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(filepath.Join(ram, "fifo.ram"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(ram, "dir.ram"), 0o755); err != nil {
		t.Fatal(err)
	}
	mnt := filepath.Join(ram, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(otherRAM, mnt, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind mount (the test runs as root): %v", err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })

	mounts := []specs.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc"},
		{Destination: "/dev/shm", Type: "tmpfs", Source: "shm"},
		{Destination: "/vm/ram", Type: "bind", Source: ram, Options: []string{"rbind"}},
		// hostPath volumes the tenant wrote into its pod spec: another
		// pod's emptyDir and a node directory.
		{Destination: "/steal", Type: "bind", Source: otherRAM, Options: []string{"rbind"}},
		{Destination: "/node", Type: "bind", Source: nodeDir, Options: []string{"rbind"}},
	}
	podDir := filepath.Join(podsDir, uid)

	f, err := openRAMFile(mounts, podDir, "/vm/ram/guest.ram")
	if err != nil {
		t.Fatalf("the pod's own RAM file: %v", err)
	}
	got, err := io.ReadAll(f)
	if err != nil || !bytes.Equal(got, guest) {
		t.Fatalf("read %d bytes (%v), want the guest's %d", len(got), err, len(guest))
	}
	if _, err := f.WriteAt([]byte("x"), 0); err == nil {
		t.Error("the RAM file was opened writable: the agent only reads it")
	}
	if fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0); err != nil || fl&unix.O_ACCMODE != unix.O_RDONLY {
		t.Errorf("open flags %#x (%v), want O_RDONLY", fl, err)
	}
	f.Close()
	// Also through a clean variant of the same path.
	if f, err := openRAMFile(mounts, podDir, "/vm//ram/./guest.ram"); err != nil {
		t.Errorf("/vm//ram/./guest.ram: %v", err)
	} else {
		f.Close()
	}

	for _, tc := range []struct {
		memPath string
		code    errcode.Code
		says    string
	}{
		{"/etc/passwd", errcode.InvalidInput, "not on a volume"},
		{"/proc/self/mem", errcode.InvalidInput, "not on a volume"},
		{"/dev/shm/guest.ram", errcode.InvalidInput, "tmpfs"},
		{"/steal/guest.ram", errcode.Forbidden, "not in the kubelet's directory of the pod"},
		{"/node/secret", errcode.Forbidden, "not in the kubelet's directory of the pod"},
		{"/vm/ram/link.ram", errcode.InvalidInput, "symbolic link"},
		{"/vm/ram/passwd", errcode.InvalidInput, "symbolic link"},
		{"/vm/ram/dirlink/guest.ram", errcode.InvalidInput, "symbolic link"},
		{"/vm/ram/mnt/guest.ram", errcode.InvalidInput, "mount point"},
		{"/vm/ram/../../etc/passwd", errcode.InvalidInput, `".."`},
		{"/vm/ram/dir.ram/../guest.ram", errcode.InvalidInput, `".."`},
		{"vm/ram/guest.ram", errcode.InvalidInput, "not absolute"},
		{"", errcode.InvalidInput, "not absolute"},
		{"/vm/ram/guest.ram\x00x", errcode.InvalidInput, "NUL"},
		{"/vm/ram/fifo.ram", errcode.InvalidInput, "not a regular file"},
		{"/vm/ram/dir.ram", errcode.InvalidInput, "not a regular file"},
		{"/vm/ram/missing.ram", errcode.VMNotFound, "no RAM file"},
		{"/vm/ram/" + strings.Repeat("a", 5000), errcode.InvalidInput, "longer than a path"},
	} {
		f, err := openRAMFile(mounts, podDir, tc.memPath)
		if f != nil {
			b, _ := io.ReadAll(io.LimitReader(f, 64))
			f.Close()
			t.Errorf("mem-path %q: opened, read %q", clip(tc.memPath), b)
			continue
		}
		if errcode.Of(err) != tc.code || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("mem-path %q: %v; want %s saying %q", clip(tc.memPath), err, tc.code, tc.says)
		}
	}

	// Without a pods directory (a trusted node, --kubelet-pods-dir ""),
	// hostPath volumes are allowed, links and the rest are still not.
	if f, err := openRAMFile(mounts, "", "/node/secret"); err != nil {
		t.Errorf("no pods directory, a hostPath volume: %v", err)
	} else {
		f.Close()
	}
	if _, err := openRAMFile(mounts, "", "/vm/ram/passwd"); errcode.Of(err) != errcode.InvalidInput {
		t.Errorf("no pods directory, a link: %v, want INVALID_INPUT", err)
	}
	// The pod's own file is the same one whichever its name: not a copy.
	st1, _ := os.Stat(filepath.Join(ram, "guest.ram"))
	if f, err := openRAMFile(mounts, podDir, "/vm/ram/guest.ram"); err == nil {
		st2, _ := f.Stat()
		if !os.SameFile(st1, st2) || st2.Sys().(*syscall.Stat_t).Ino != st1.Sys().(*syscall.Stat_t).Ino {
			t.Error("opened another file than the volume's")
		}
		f.Close()
	}
}
