package containerd

// Paths and names from API callers, mapped to host paths through a
// container's mounts: ".." and symbolic links inside a volume must never
// lead outside the volume's source, and malformed pod UIDs and container
// names are refused before containerd is asked anything.

import (
	"context"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// volumeTree builds DIR/vol (the bind mount's source) holding a file, a
// socket, a directory and symbolic links that escape it in every way, and
// DIR/outside that none of them may reach.
func volumeTree(tb testing.TB) (dir string, mounts []specs.Mount) {
	tb.Helper()
	dir = tb.TempDir()
	vol := filepath.Join(dir, "vol")
	for _, d := range []string{"vol/sub", "outside"} {
		os.MkdirAll(filepath.Join(dir, d), 0o755)
	}
	os.WriteFile(filepath.Join(vol, "disk.qcow2"), []byte("x"), 0o600)
	os.WriteFile(filepath.Join(vol, "sub", "disk.qcow2"), []byte("x"), 0o600)
	os.WriteFile(filepath.Join(dir, "outside", "secret"), []byte("x"), 0o600)
	if l, err := net.Listen("unix", filepath.Join(vol, "qmp.sock")); err == nil {
		tb.Cleanup(func() { l.Close() })
	}
	syscall.Mkfifo(filepath.Join(vol, "fifo"), 0o600) // opening it for reading would block
	os.Symlink("/etc", filepath.Join(vol, "etc"))
	os.Symlink("../outside", filepath.Join(vol, "up"))
	os.Symlink("../outside/secret", filepath.Join(vol, "secret"))
	os.Symlink("disk.qcow2", filepath.Join(vol, "alias.qcow2")) // inside, but still a link
	os.Symlink(filepath.Join(dir, "outside"), filepath.Join(vol, "sub", "abs"))
	mounts = []specs.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc"},
		{Destination: "/run/vm", Type: "bind", Source: vol, Options: []string{"rbind"}},
		{Destination: "/run/vm/tmp", Type: "tmpfs", Source: "tmpfs"},
		{Destination: "/esc", Type: "bind", Source: vol + "/../outside"},
	}
	return dir, mounts
}

func TestHostPathRefusesEscapes(t *testing.T) {
	dir, mounts := volumeTree(t)
	vol := filepath.Join(dir, "vol")
	for _, tc := range []struct {
		p    string
		mode fs.FileMode
		want string
		code errcode.Code
	}{
		{"/run/vm/disk.qcow2", 0, filepath.Join(vol, "disk.qcow2"), ""},
		{"/run/vm/sub/disk.qcow2", 0, filepath.Join(vol, "sub/disk.qcow2"), ""},
		{"/run/vm/qmp.sock", fs.ModeSocket, filepath.Join(vol, "qmp.sock"), ""},
		{"/run/vm/etc/passwd", 0, "", errcode.InvalidInput},             // link to /etc
		{"/run/vm/up/secret", 0, "", errcode.InvalidInput},              // relative link out of the volume
		{"/run/vm/secret", 0, "", errcode.InvalidInput},                 // link to a file outside
		{"/run/vm/alias.qcow2", 0, "", errcode.InvalidInput},            // a link even if it stays inside
		{"/run/vm/sub/abs/secret", 0, "", errcode.InvalidInput},         // absolute link in a subdirectory
		{"/run/vm/disk.qcow2", fs.ModeSocket, "", errcode.InvalidInput}, // not a socket
		{"/run/vm/qmp.sock", 0, "", errcode.InvalidInput},               // not a regular file
		{"/run/vm/sub", 0, "", errcode.InvalidInput},                    // a directory
		{"/run/vm/fifo", 0, "", errcode.InvalidInput},                   // a named pipe: refused, not opened
		{"/run/vm/nothing", 0, "", errcode.VMNotFound},
		{"/run/vm/disk.qcow2/x", 0, "", errcode.VMNotFound},                  // ENOTDIR: was INTERNAL
		{"/run/vm/" + strings.Repeat("0", 300), 0, "", errcode.InvalidInput}, // ENAMETOOLONG: was INTERNAL
		{"/run/vm/tmp/x", 0, "", errcode.InvalidInput},                       // on a tmpfs, not a volume
		{"/esc/secret", 0, "", errcode.InvalidInput},                         // source with ".."
		{"/etc/passwd", 0, "", errcode.InvalidInput},                         // the container's root filesystem
	} {
		got, err := openedPath(t, mounts, tc.p, tc.mode)
		if tc.code != "" {
			if errcode.Of(err) != tc.code {
				t.Errorf("%s: %q, %v (code %s); want %s", tc.p, got, err, errcode.Of(err), tc.code)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%s: %q, %v; want %q", tc.p, got, err, tc.want)
		}
	}
	for _, p := range []string{"run/vm/disk.qcow2", "/run/vm/../../etc/passwd", "/run/vm/sub/../../x", "/run/vm/disk\x00.qcow2", "", "..", "/.."} {
		if _, err := containerPath("disk", p); errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("containerPath(%q) = %v, want INVALID_INPUT", p, err)
		}
	}
}

// openedPath is hostPath for tests: the host path, once it has checked that
// the file hostPath opened is the one at that path (and of the type asked
// for), and closed it.
func openedPath(t *testing.T, mounts []specs.Mount, p string, mode fs.FileMode) (string, error) {
	t.Helper()
	host, f, err := hostPath(mounts, "", "disk", p, mode)
	if err != nil {
		if f != nil {
			t.Fatalf("%s: an error (%v) and a file", p, err)
		}
		return host, err
	}
	defer f.Close()
	opened, err1 := f.Stat()
	named, err2 := os.Lstat(host)
	if err1 != nil || err2 != nil || !os.SameFile(opened, named) || opened.Mode().Type() != mode {
		t.Fatalf("%s: opened %v (%v), but %s is %v (%v)", p, opened, err1, host, named, err2)
	}
	return host, nil
}

// TestResolveRefusesMalformedNames: refused before containerd is asked (the
// resolver here has no client at all).
func TestResolveRefusesMalformedNames(t *testing.T) {
	r := &Resolver{}
	uid := "3f2c1a9e-8b7d-4c6e-9f10-2a3b4c5d6e7f"
	for _, tc := range []struct {
		ref  agent.VMRef
		code errcode.Code
	}{
		{agent.VMRef{PodUID: "", Container: "qemu", QMPPath: "/q"}, errcode.VMNotFound},
		{agent.VMRef{PodUID: "web-0", Container: "qemu", QMPPath: "/q"}, errcode.InvalidInput},
		{agent.VMRef{PodUID: "../../../etc/passwd", Container: "qemu", QMPPath: "/q"}, errcode.InvalidInput},
		{agent.VMRef{PodUID: uid + "\x00", Container: "qemu", QMPPath: "/q"}, errcode.InvalidInput},
		{agent.VMRef{PodUID: strings.Replace(uid, "-", "/", 1), Container: "qemu", QMPPath: "/q"}, errcode.InvalidInput},
		{agent.VMRef{PodUID: strings.Replace(uid, "f", "g", 1), Container: "qemu", QMPPath: "/q"}, errcode.InvalidInput},
		{agent.VMRef{PodUID: `3f2c1a9e-8b7d-4c6e-9f10-2a3b4c5d6e7"`, Container: "qemu", QMPPath: "/q"}, errcode.InvalidInput},
		{agent.VMRef{PodUID: strings.Repeat("a", 1<<20), Container: "qemu", QMPPath: "/q"}, errcode.InvalidInput},
		{agent.VMRef{PodUID: uid, Container: "", QMPPath: "/q"}, errcode.InvalidInput},
		{agent.VMRef{PodUID: uid, Container: `qemu",labels.x=="y`, QMPPath: "/q"}, errcode.InvalidInput},
		{agent.VMRef{PodUID: uid, Container: "qemu", QMPPath: ""}, errcode.InvalidInput},
		{agent.VMRef{PodUID: uid, Container: "qemu", QMPPath: "/run/../../etc/q"}, errcode.InvalidInput},
		{agent.VMRef{PodUID: uid, Container: "qemu", QMPPath: "q.sock"}, errcode.InvalidInput},
		{agent.VMRef{PodUID: uid, Container: "qemu", QMPPath: "/q", DiskPath: "/run/vm/../../d"}, errcode.InvalidInput},
	} {
		_, err := r.Resolve(context.Background(), tc.ref)
		if errcode.Of(err) != tc.code {
			t.Errorf("Resolve(%.80q) = %v (code %s), want %s", tc.ref, err, errcode.Of(err), tc.code)
		}
		if err != nil && len(err.Error()) > 600 {
			t.Errorf("error repeats the whole input: %d bytes", len(err.Error()))
		}
	}
}

// FuzzHostPath: any path a caller names maps, if at all, to a path inside
// the source of a bind mount, with no symbolic link below that source.
func FuzzHostPath(f *testing.F) {
	for _, p := range []string{"/run/vm/disk.qcow2", "/run/vm/qmp.sock", "/run/vm/etc/passwd", "/run/vm/up/secret",
		"/run/vm/./sub//disk.qcow2", "/run/vm/sub/abs/secret", "/run/vm/../vm/disk.qcow2", "/esc/secret", "run/vm/x"} {
		f.Add(p, false)
		f.Add(p, true)
	}
	dir, mounts := volumeTree(f)
	vol := filepath.Join(dir, "vol")
	f.Fuzz(func(t *testing.T, p string, socket bool) {
		mode := fs.FileMode(0)
		if socket {
			mode = fs.ModeSocket
		}
		clean, err := containerPath("disk", p)
		if err != nil {
			if errcode.Of(err) != errcode.InvalidInput {
				t.Fatalf("containerPath(%q): %v", p, err)
			}
			return
		}
		host, err := openedPath(t, mounts, clean, mode)
		if err != nil {
			if c := errcode.Of(err); c != errcode.InvalidInput && c != errcode.VMNotFound {
				t.Fatalf("hostPath(%q): %v (code %s)", clean, err, c)
			}
			return
		}
		if !within(host, vol) {
			t.Fatalf("%q mapped to %q, outside the volume %s", p, host, vol)
		}
		for cur := host; within(cur, vol) && cur != vol; cur = filepath.Dir(cur) {
			if fi, err := os.Lstat(cur); err != nil || fi.Mode()&fs.ModeSymlink != 0 {
				t.Fatalf("%q mapped to %q, through the link %s", p, host, cur)
			}
		}
	})
}

// FuzzResolveNames: arbitrary pod UIDs and container names are either
// well formed or refused with a code, before containerd is asked.
func FuzzResolveNames(f *testing.F) {
	f.Add("3f2c1a9e-8b7d-4c6e-9f10-2a3b4c5d6e7f", "qemu", "/run/vm/qmp.sock")
	f.Add("0123456789ABCDEF0123456789abcdef", "vm-1", "/q")
	f.Add("../../etc", "qemu", "/q")
	f.Add("3f2c1a9e-8b7d-4c6e-9f10-2a3b4c5d6e7f", `a",labels.x=="`, "/q")
	f.Fuzz(func(t *testing.T, uid, name, qmpPath string) {
		if validPodUID(uid) && validContainerName(name) {
			if _, err := containerPath("QMP socket", qmpPath); err == nil {
				// Well formed: the next step asks containerd; check the
				// filter it would build cannot be broken out of.
				if strings.ContainsAny(uid+name, `"\,=`) {
					t.Fatalf("accepted %q / %q", uid, name)
				}
				return
			}
		}
		_, err := (&Resolver{}).Resolve(context.Background(), agent.VMRef{PodUID: uid, Container: name, QMPPath: qmpPath})
		if c := errcode.Of(err); c != errcode.InvalidInput && c != errcode.VMNotFound {
			t.Fatalf("Resolve(%q, %q, %q): %v (code %s)", uid, name, qmpPath, err, c)
		}
	})
}
