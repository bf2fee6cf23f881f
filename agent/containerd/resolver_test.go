package containerd

import (
	"context"
	"errors"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/internal/errcode"
	testcontainerd "github.com/vmsnap/vmsnap/internal/testing/containerd"
)

// env is a containerd with one running pod container whose volume (HostDir,
// mounted at /run/vm) holds a listening QMP-like socket and a disk file.
type env struct {
	d   *testcontainerd.Daemon
	r   *Resolver
	uid string
	c   *testcontainerd.Container
}

func newEnv(t *testing.T) *env {
	t.Helper()
	d := testcontainerd.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := New(ctx, d.Address, "", WithRetryMax(500*time.Millisecond), WithLogger(testLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	if r.Namespace() != DefaultNamespace {
		t.Errorf("namespace %q, want %q", r.Namespace(), DefaultNamespace)
	}
	e := &env{d: d, r: r, uid: testcontainerd.NewPodUID()}
	e.c = d.Create(t, testcontainerd.PodContainer{PodUID: e.uid, Name: "qemu"})
	listenUnix(t, filepath.Join(e.c.HostDir, "qmp.sock"))
	if err := os.WriteFile(filepath.Join(e.c.HostDir, "disk.qcow2"), []byte("QFI\xfb"), 0o600); err != nil {
		t.Fatal(err)
	}
	return e
}

// listenUnix serves a unix socket at path that answers "hello" to each
// connection.
func listenUnix(t *testing.T, path string) {
	t.Helper()
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("hello"))
			c.Close()
		}
	}()
}

func (e *env) ref() agent.VMRef {
	return agent.VMRef{PodUID: e.uid, Container: "qemu", QMPPath: "/run/vm/qmp.sock", DiskPath: "/run/vm/disk.qcow2"}
}

func resolve(t *testing.T, r *Resolver, ref agent.VMRef) (agent.Target, time.Duration, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	t0 := time.Now()
	vm, err := r.Resolve(ctx, ref)
	took := time.Since(t0) // for the log: how long is a benchmark's question
	// Every answer is containerd's: a resolver that waited (for a pod to
	// appear, a retry) would end by the deadline instead.
	if errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Resolve(%+v) ended by its deadline, not by an answer: %v", ref, err)
	}
	if err != nil {
		if vm != nil {
			t.Fatalf("Resolve returned an error (%v) and a VM", err)
		}
		return agent.Target{}, took, err
	}
	defer vm.Close()
	checkOpened(t, "QMP socket", vm.QMP, vm.QMPPath, fs.ModeSocket)
	if (vm.Disk != nil) != (vm.DiskPath != "") {
		t.Fatalf("disk path %q but disk file %v", vm.DiskPath, vm.Disk)
	}
	if vm.Disk != nil {
		checkOpened(t, "disk", vm.Disk, vm.DiskPath, 0)
	}
	return vm.Target, took, nil
}

// checkOpened fails unless f is open on the file of type typ at host.
func checkOpened(t *testing.T, what string, f *os.File, host string, typ fs.FileMode) {
	t.Helper()
	opened, err1 := f.Stat()
	named, err2 := os.Lstat(host)
	if err1 != nil || err2 != nil || !os.SameFile(opened, named) || opened.Mode().Type() != typ {
		t.Fatalf("%s: opened %v (%v), but %s is %v (%v)", what, opened, err1, host, named, err2)
	}
}

func wantCode(t *testing.T, what string, err error, code errcode.Code, msgPart string) {
	t.Helper()
	if got := errcode.Of(err); got != code {
		t.Errorf("%s: code %q (err %v), want %s", what, got, err, code)
		return
	}
	if msgPart != "" && !strings.Contains(err.Error(), msgPart) {
		t.Errorf("%s: message %q does not mention %q", what, err, msgPart)
	}
}

func TestResolveMapsPathsToVolume(t *testing.T) {
	e := newEnv(t)
	tg, took, err := resolve(t, e.r, e.ref())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("resolved in %v: %+v", took, tg)
	want := agent.Target{
		PodUID: e.uid, Container: "qemu", ContainerID: e.c.ID, Namespace: "default",
		QMPPath:  filepath.Join(e.c.HostDir, "qmp.sock"),
		DiskPath: filepath.Join(e.c.HostDir, "disk.qcow2"),
	}
	if tg != want {
		t.Fatalf("target\n %+v\nwant\n %+v", tg, want)
	}
	// It is the very socket the container sees.
	conn, err := net.Dial("unix", tg.QMPPath)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	conn.Read(buf)
	conn.Close()
	if string(buf) != "hello" {
		t.Errorf("socket said %q", buf)
	}

	// Untidy but harmless spellings map to the same place; no disk is fine.
	ref := agent.VMRef{PodUID: e.uid, Container: "qemu", QMPPath: "/run//vm/./qmp.sock"}
	if tg, _, err = resolve(t, e.r, ref); err != nil || tg.QMPPath != want.QMPPath || tg.DiskPath != "" {
		t.Errorf("untidy path: %+v, %v", tg, err)
	}

	// The longest mount wins: a volume mounted inside the first one.
	inner := t.TempDir()
	listenUnix(t, filepath.Join(inner, "qmp.sock"))
	uid2 := testcontainerd.NewPodUID()
	e.d.Create(t, testcontainerd.PodContainer{PodUID: uid2, Name: "vm-1",
		Mounts: []specs.Mount{{Destination: "/run/vm/inner", Type: "bind", Source: inner, Options: []string{"rbind"}}}})
	tg, _, err = resolve(t, e.r, agent.VMRef{PodUID: uid2, Container: "vm-1", QMPPath: "/run/vm/inner/qmp.sock"})
	if err != nil || tg.QMPPath != filepath.Join(inner, "qmp.sock") {
		t.Errorf("nested volume: %+v, %v", tg, err)
	}
}

func TestResolveNotFound(t *testing.T) {
	e := newEnv(t)
	// Warm up the connection so the timings below are of the lookups only.
	if _, _, err := resolve(t, e.r, e.ref()); err != nil {
		t.Fatal(err)
	}

	ref := e.ref()
	ref.PodUID = testcontainerd.NewPodUID()
	_, took, err := resolve(t, e.r, ref)
	wantCode(t, "unknown pod UID", err, errcode.VMNotFound, ref.PodUID)
	t.Logf("unknown UID: VM_NOT_FOUND in %v", took)

	ref.PodUID = "0123456789abcdef0123456789abcdef" // a static pod's UID form
	_, _, err = resolve(t, e.r, ref)
	wantCode(t, "unknown static pod UID", err, errcode.VMNotFound, "no pod")

	ref.PodUID = ""
	_, _, err = resolve(t, e.r, ref)
	wantCode(t, "empty UID", err, errcode.VMNotFound, "pod UID")

	for _, bad := range []string{"not-a-uid", strings.ToUpper(e.uid) + "0", e.uid[:35], "../" + e.uid[3:], `" || true`, e.uid[:8] + "_" + e.uid[9:]} {
		ref.PodUID = bad
		_, _, err = resolve(t, e.r, ref)
		wantCode(t, "malformed UID "+bad, err, errcode.InvalidInput, "malformed")
	}

	ref = e.ref()
	ref.Container = "sidecar"
	_, _, err = resolve(t, e.r, ref)
	wantCode(t, "wrong container name", err, errcode.VMNotFound, `"sidecar"`)
	if err != nil && !strings.Contains(err.Error(), "qemu") {
		t.Errorf("wrong container: message %q does not list the pod's containers", err)
	}
	ref.Container = ""
	_, _, err = resolve(t, e.r, ref)
	wantCode(t, "no container name", err, errcode.InvalidInput, "container")
	ref.Container = "Bad_Name"
	_, _, err = resolve(t, e.r, ref)
	wantCode(t, "malformed container name", err, errcode.InvalidInput, "malformed")

	// The pod's name is not a way in.
	ref = e.ref()
	ref.PodUID = "vm"
	_, _, err = resolve(t, e.r, ref)
	wantCode(t, "pod name as UID", err, errcode.InvalidInput, "")
}

func TestResolvePathErrors(t *testing.T) {
	e := newEnv(t)
	if err := os.Symlink("/etc", filepath.Join(e.c.HostDir, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/run/containerd/containerd.sock", filepath.Join(e.c.HostDir, "evil.sock")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(e.c.HostDir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		qmp, disk string
		code      errcode.Code
		msg       string
	}{
		{"/tmp/qmp.sock", "", errcode.InvalidInput, "must be on a volume"},     // the container's rootfs
		{"/qmp.sock", "", errcode.InvalidInput, "root filesystem"},             // ditto
		{"/run/qmp.sock", "", errcode.InvalidInput, "tmpfs"},                   // the spec's /run tmpfs
		{"/dev/shm/qmp.sock", "", errcode.InvalidInput, "not on a volume"},     // another tmpfs
		{"/proc/1/root/x.sock", "", errcode.InvalidInput, "proc"},              // not a bind mount
		{"/run/vm/../vm/qmp.sock", "", errcode.InvalidInput, `".."`},           // never with ..
		{"/run/vm/../../etc/passwd", "", errcode.InvalidInput, `".."`},         // escape attempt
		{"/run/vm/qmp.sock", "/run/vm/../../disk", errcode.InvalidInput, ".."}, // disk too
		{"run/vm/qmp.sock", "", errcode.InvalidInput, "not absolute"},
		{"/run/vm/link/qmp.sock", "", errcode.InvalidInput, "symbolic link"},
		{"/run/vm/evil.sock", "", errcode.InvalidInput, "symbolic link"},
		{"/run/vm/disk.qcow2", "", errcode.InvalidInput, "not a unix socket"},
		{"/run/vm/qmp.sock", "/run/vm/qmp.sock", errcode.InvalidInput, "not a regular file"},
		{"/run/vm/qmp.sock", "/run/vm/sub", errcode.InvalidInput, "not a regular file"},
		{"/run/vm/qmp.sock", "/tmp/disk.qcow2", errcode.VMNotFound, "writable layer"}, // not there either
		{"/run/vm/missing.sock", "", errcode.VMNotFound, "no QMP socket"},
		{"/run/vm/sub/deeper/qmp.sock", "", errcode.VMNotFound, "does not exist"},
		{"/run/vm/qmp.sock", "/run/vm/nodisk.qcow2", errcode.VMNotFound, "no disk"},
		{"", "", errcode.InvalidInput, "QMP"},
	} {
		ref := agent.VMRef{PodUID: e.uid, Container: "qemu", QMPPath: tc.qmp, DiskPath: tc.disk}
		tg, _, err := resolve(t, e.r, ref)
		if err == nil {
			t.Errorf("qmp %q disk %q: resolved to %+v, want %s", tc.qmp, tc.disk, tg, tc.code)
			continue
		}
		wantCode(t, "qmp "+tc.qmp+" disk "+tc.disk, err, tc.code, tc.msg)
	}
}

// TestResolveDiskInWritableLayer: a disk on none of the container's mounts
// is the file in its writable layer, found in the snapshot's upper
// directory, where QEMU's writes land; links and odd files are refused as
// on a volume.
func TestResolveDiskInWritableLayer(t *testing.T) {
	e := newEnv(t)
	execIn(t, e, e.c, "/bin/busybox", "sh", "-c", strings.Join([]string{
		"mkdir -p /vm/disk /vm/dir",
		"echo overlay > /vm/disk/overlay.qcow2",
		"ln -s /vm/disk /vm/link",
		"ln -s overlay.qcow2 /vm/disk/alias.qcow2",
	}, " && "))
	ref := e.ref()
	ref.DiskPath = "/vm//disk/./overlay.qcow2"
	tg, _, err := resolve(t, e.r, ref)
	if err != nil {
		t.Fatal(err)
	}
	if !tg.DiskInRootfs || tg.QMPPath != filepath.Join(e.c.HostDir, "qmp.sock") || strings.HasPrefix(tg.DiskPath, e.c.HostDir) {
		t.Fatalf("target %+v: want the disk in the writable layer", tg)
	}
	if b, err := os.ReadFile(tg.DiskPath); err != nil || string(b) != "overlay\n" {
		t.Fatalf("%s holds %q, %v: not the container's file", tg.DiskPath, b, err)
	}
	// Writes through the host path are what the container sees (the
	// snapshot's upper directory is the layer itself).
	if err := os.WriteFile(tg.DiskPath, []byte("rewritten\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	execIn(t, e, e.c, "/bin/busybox", "sh", "-c", "cp /vm/disk/overlay.qcow2 /run/vm/seen")
	if b, _ := os.ReadFile(filepath.Join(e.c.HostDir, "seen")); string(b) != "rewritten\n" {
		t.Fatalf("the container sees %q, not what was written at %s", b, tg.DiskPath)
	}
	// A disk on a volume is not in the writable layer.
	if tg, _, err := resolve(t, e.r, e.ref()); err != nil || tg.DiskInRootfs {
		t.Fatalf("disk on the volume: %+v, %v", tg, err)
	}
	for _, tc := range []struct {
		disk string
		code errcode.Code
		msg  string
	}{
		{"/vm/link/overlay.qcow2", errcode.InvalidInput, "symbolic link"},
		{"/vm/disk/alias.qcow2", errcode.InvalidInput, "symbolic link"},
		{"/vm/dir", errcode.InvalidInput, "not a regular file"},
		{"/vm/disk/none.qcow2", errcode.VMNotFound, "writable layer"},
		{"/bin/busybox", errcode.VMNotFound, "writable layer"}, // in the image, never written
		{"/dev/shm/x", errcode.InvalidInput, "tmpfs"},          // on a mount that is no volume
	} {
		ref.DiskPath = tc.disk
		tg, _, err := resolve(t, e.r, ref)
		if err == nil {
			t.Errorf("disk %s: resolved to %+v, want %s", tc.disk, tg, tc.code)
			continue
		}
		wantCode(t, "disk "+tc.disk, err, tc.code, tc.msg)
	}
}

// TestUpperDir: the writable layer's directory from a snapshot's mounts.
func TestUpperDir(t *testing.T) {
	for _, tc := range []struct {
		mounts []mount.Mount
		want   string
	}{
		{[]mount.Mount{{Type: "overlay", Source: "overlay", Options: []string{"index=off", "workdir=/s/2/work", "upperdir=/s/2/fs", "lowerdir=/s/1/fs"}}}, "/s/2/fs"},
		{[]mount.Mount{{Type: "overlay", Source: "overlay", Options: []string{`upperdir=/s/a\,b/fs`}}}, "/s/a,b/fs"},
		{[]mount.Mount{{Type: "bind", Source: "/s/1/fs", Options: []string{"rbind", "rw"}}}, "/s/1/fs"},
		{[]mount.Mount{{Type: "none", Source: "/s/1/fs", Options: []string{"rbind"}}}, "/s/1/fs"},
		{[]mount.Mount{{Type: "overlay", Source: "overlay", Options: []string{"lowerdir=/s/1/fs:/s/0/fs"}}}, ""}, // a view
		{[]mount.Mount{{Type: "bind", Source: "/s/1/fs", Options: []string{"rbind", "ro"}}}, ""},
		{[]mount.Mount{{Type: "ext4", Source: "/dev/dm-3"}}, ""},
		{[]mount.Mount{{Type: "overlay", Options: []string{"upperdir=s/2/fs"}}}, ""},
		{[]mount.Mount{{Type: "overlay", Options: []string{"upperdir=/s/../../etc"}}}, ""},
		{nil, ""},
	} {
		got, err := upperDir(tc.mounts)
		if tc.want == "" {
			if err == nil {
				t.Errorf("%+v: %q, want an error", tc.mounts, got)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%+v: %q, %v; want %q", tc.mounts, got, err, tc.want)
		}
	}
}

func TestResolvePicksNewestRunning(t *testing.T) {
	e := newEnv(t)
	// A restart: the kubelet keeps the exited container next to the new
	// one, with the same labels and volume.
	e.d.Kill(t, e.c)
	_, _, err := resolve(t, e.r, e.ref())
	wantCode(t, "only container stopped", err, errcode.VMNotFound, "not running")

	second := e.d.Create(t, testcontainerd.PodContainer{PodUID: e.uid, Name: "qemu", HostDir: e.c.HostDir})
	tg, _, err := resolve(t, e.r, e.ref())
	if err != nil || tg.ContainerID != second.ID {
		t.Fatalf("after restart: %+v, %v; want container %s", tg, err, second.ID)
	}
	// Two running (not what a kubelet does, but possible): the newest.
	third := e.d.Create(t, testcontainerd.PodContainer{PodUID: e.uid, Name: "qemu", HostDir: e.c.HostDir})
	if tg, _, err = resolve(t, e.r, e.ref()); err != nil || tg.ContainerID != third.ID {
		t.Fatalf("two running: %+v, %v; want the newest, %s", tg, err, third.ID)
	}
	e.d.Kill(t, third)
	if tg, _, err = resolve(t, e.r, e.ref()); err != nil || tg.ContainerID != second.ID {
		t.Fatalf("newest stopped: %+v, %v; want %s", tg, err, second.ID)
	}
	// Another namespace is another world.
	other, err := New(context.Background(), e.d.Address, "other")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	_, _, err = resolve(t, other, e.ref())
	wantCode(t, "other namespace", err, errcode.VMNotFound, "namespace other")
}

func TestNewUnreachable(t *testing.T) {
	// Without a socket New answers at once: it returns before its
	// context ends, which a New that waited for the socket would not.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := New(ctx, filepath.Join(t.TempDir(), "none.sock"), "")
	wantCode(t, "no socket", err, errcode.Internal, "no containerd socket")
	if ctx.Err() != nil {
		t.Errorf("New without a socket waited for its context to end: %v", err)
	}
	// A socket nobody serves: New gives up when ctx ends.
	dead := filepath.Join(t.TempDir(), "dead.sock")
	l, err := net.Listen("unix", dead)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	ctx, cancel = context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err = New(ctx, "unix://"+dead, "")
	wantCode(t, "dead socket", err, errcode.Internal, "does not answer")
}

// TestHostPath checks the mount mapping rules on synthetic specs, including
// cases a real runtime would not produce.
func TestHostPath(t *testing.T) {
	dir := t.TempDir()
	for _, sub := range []string{"a", "b", "a/inner"} {
		os.MkdirAll(filepath.Join(dir, sub), 0o755)
	}
	for _, f := range []string{"a/f", "b/f", "a/inner/f", "single"} {
		os.WriteFile(filepath.Join(dir, f), nil, 0o600)
	}
	mounts := []specs.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc"},
		{Destination: "/data", Type: "bind", Source: filepath.Join(dir, "a"), Options: []string{"rbind"}},
		{Destination: "/data/x", Type: "tmpfs", Source: "tmpfs"},
		{Destination: "/file", Type: "bind", Source: filepath.Join(dir, "single")},
		{Destination: "/legacy", Source: filepath.Join(dir, "b"), Options: []string{"bind", "ro"}}, // no type: a bind by its options
		{Destination: "/over", Type: "bind", Source: filepath.Join(dir, "a")},
		{Destination: "/over/", Type: "bind", Source: filepath.Join(dir, "b")}, // same place, later: on top
		{Destination: "/esc", Type: "bind", Source: dir + "/a/../.."},
		{Destination: "/rel", Type: "bind", Source: "a"},
	}
	for _, tc := range []struct {
		p, want string
		code    errcode.Code
	}{
		{"/data/f", filepath.Join(dir, "a/f"), ""},
		{"/data/inner/f", filepath.Join(dir, "a/inner/f"), ""},
		{"/data/x/f", "", errcode.InvalidInput}, // shadowed by the tmpfs
		{"/datax/f", "", errcode.InvalidInput},  // a prefix of the string, not of the path
		{"/file", filepath.Join(dir, "single"), ""},
		{"/legacy/f", filepath.Join(dir, "b/f"), ""},
		{"/over/f", filepath.Join(dir, "b/f"), ""},
		{"/esc/etc/passwd", "", errcode.InvalidInput},
		{"/rel/f", "", errcode.InvalidInput},
	} {
		got, err := openedPath(t, mounts, tc.p, 0)
		if tc.code != "" {
			if errcode.Of(err) != tc.code {
				t.Errorf("%s: %q, %v; want %s", tc.p, got, err, tc.code)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%s: %q, %v; want %q", tc.p, got, err, tc.want)
		}
	}
	for _, uid := range []string{"3f2c1a9e-8b7d-4c6e-9f10-2a3b4c5d6e7f", "0123456789ABCDEF0123456789abcdef"} {
		if !validPodUID(uid) {
			t.Errorf("%s refused", uid)
		}
	}
	for _, name := range []string{"qemu", "vm-1", strings.Repeat("a", 63)} {
		if !validContainerName(name) {
			t.Errorf("container name %q refused", name)
		}
	}
	for _, name := range []string{"-a", "a-", "A", "a.b", strings.Repeat("a", 64), `a"`} {
		if validContainerName(name) {
			t.Errorf("container name %q accepted", name)
		}
	}
}

// execIn runs a short process in c's task and waits for it to exit.
func execIn(t *testing.T, e *env, c *testcontainerd.Container, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(e.d.Context(context.Background()), 20*time.Second)
	defer cancel()
	spec, err := c.Container.Spec(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pspec := *spec.Process
	pspec.Args = args
	p, err := c.Task.Exec(ctx, "exec-"+testcontainerd.NewID()[:8], &pspec, nullIO)
	if err != nil {
		t.Fatal(err)
	}
	exit, err := p.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Start(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-exit:
	case <-ctx.Done():
		t.Fatal("exec did not exit")
	}
	p.Delete(ctx)
}

// testLogger sends the resolver's logs, debug included, to the test log,
// until the test's cleanup ends (a log line after that would panic).
func testLogger(t *testing.T) *slog.Logger {
	w := &testWriter{t: t}
	t.Cleanup(func() {
		w.mu.Lock()
		w.done = true
		w.mu.Unlock()
	})
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct {
	t    *testing.T
	mu   sync.Mutex
	done bool
}

func (w *testWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Log(strings.TrimRight(string(b), "\n"))
	}
	return len(b), nil
}

// A pod being deleted has its task gone before its container: containerd's
// task service answers NotFound (a gRPC status), which is VM_NOT_FOUND, not
// a failure of the agent.
func TestResolveContainerWithoutTask(t *testing.T) {
	e := newEnv(t)
	e.d.Kill(t, e.c)
	ctx, cancel := context.WithTimeout(e.d.Context(context.Background()), 30*time.Second)
	defer cancel()
	if _, err := e.c.Task.Delete(ctx); err != nil {
		t.Fatal(err)
	}
	e.c.Task = nil // deleted: the cleanup deletes only the container
	_, _, err := resolve(t, e.r, e.ref())
	wantCode(t, "a container whose task is deleted", err, errcode.VMNotFound, "has no task")
}
