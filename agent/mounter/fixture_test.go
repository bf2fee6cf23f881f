package mounter

import (
	"bufio"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

// The tests mount for real: they need root (CI runs as root) and skip
// loudly otherwise (fail under VMSNAP_TEST_REQUIRE_QEMU=1).
func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		guest.SkipOrFail(t, "mounter", "bind mounts, open_tree and move_mount need root")
	}
}

// fixture is a running mounter over a temporary pods directory and
// publication root, with a decoy directory beside them that must never
// receive a mount.
type fixture struct {
	root, pods, pub, decoy string
	srv                    *Server
	client                 Client
	stop                   func() error // stops the server, once; Serve's error
}

const testUID = "0b6a4a5e-35c1-4a7c-9f0e-6a2d3c1b9e11"

// setup is what a test may change before the mounter starts.
type setup struct {
	cfg             Config
	afterTargetOpen func()
	// shared makes the fixture's directory a shared mount, as the
	// kubelet's directory is (the cache's may be too).
	shared bool
	// shutdownGrace replaces the server's, if not 0.
	shutdownGrace time.Duration
}

func newFixture(t testing.TB, configure ...func(*setup)) *fixture {
	t.Helper()
	requireRoot(t)
	root := t.TempDir()
	f := &fixture{root: root, pods: root + "/pods", pub: root + "/pub", decoy: root + "/decoy"}
	for _, d := range []string{f.pods, f.pub, f.decoy} {
		must(t, os.MkdirAll(d, 0o755))
	}
	t.Cleanup(func() { detachAllBelow(root) }) // runs last: after the server stopped
	set := setup{cfg: Config{Socket: root + "/run/mounter.sock", PodsDir: f.pods, PublicationRoots: []string{f.pub}, AgentGID: -1}}
	for _, c := range configure {
		c(&set)
	}
	if set.shared {
		must(t, unix.Mount(root, root, "", unix.MS_BIND, ""))
		t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) })
		must(t, unix.Mount("", root, "", unix.MS_SHARED, ""))
	}
	srv, err := New(set.cfg)
	must(t, err)
	srv.afterTargetOpen = set.afterTargetOpen
	if set.shutdownGrace != 0 {
		srv.shutdownGrace = set.shutdownGrace
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	f.stop = sync.OnceValue(func() error {
		cancel()
		return <-done
	})
	t.Cleanup(func() {
		if err := f.stop(); err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	f.srv, f.client = srv, Client{Socket: set.cfg.Socket}
	return f
}

// volume makes what the kubelet and the agent prepare for a pod's inline
// volume: the kubelet's volume directory (not its mount leaf) and a
// publication holding a file "marker". It returns the publish request.
func (f *fixture) volume(t testing.TB, podUID, name string) PublishRequest {
	t.Helper()
	id := VolumeHandle(podUID, name)
	dir := filepath.Join(f.pods, podUID, "volumes", "kubernetes.io~csi", name)
	must(t, os.MkdirAll(dir, 0o750))
	src := filepath.Join(f.pub, "ns", "pub", id)
	must(t, os.MkdirAll(src, 0o755))
	must(t, os.WriteFile(filepath.Join(src, "marker"), []byte(id), 0o644))
	return PublishRequest{VolumeID: id, PodUID: podUID, Target: dir + "/mount", Source: src, ReadOnly: true}
}

func unpublishOf(r PublishRequest) UnpublishRequest {
	return UnpublishRequest{VolumeID: r.VolumeID, Target: r.Target}
}

// mountsBelow lists the mount points at or below dir, from mountinfo.
func mountsBelow(t testing.TB, dir string) []string {
	t.Helper()
	var out []string
	mi, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer mi.Close()
	sc := bufio.NewScanner(mi)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && (fields[4] == dir || strings.HasPrefix(fields[4], dir+"/")) {
			out = append(out, fields[4])
		}
	}
	return out
}

// mountOptions is the per-mount options of the top mount on dir.
func mountOptions(t testing.TB, dir string) []string {
	return strings.Split(topMount(t, dir)[5], ",")
}

// peerGroup is the shared:N field of the top mount on dir ("" if it is not
// shared).
func peerGroup(t testing.TB, dir string) string {
	for _, f := range topMount(t, dir)[6:] {
		if strings.HasPrefix(f, "shared:") {
			return f
		}
	}
	return ""
}

// topMount is the mountinfo line of the top mount on dir, in fields.
func topMount(t testing.TB, dir string) []string {
	t.Helper()
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var top []string
	for line := range strings.SplitSeq(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 6 && f[4] == dir {
			top = f // the last line for dir is the top mount
		}
	}
	if top == nil {
		t.Fatalf("nothing is mounted on %s", dir)
	}
	return top
}

// detachAllBelow unmounts whatever a test left mounted below dir, deepest
// first, so that a failing test does not leave mounts on the machine.
func detachAllBelow(dir string) {
	var points []string
	data, _ := os.ReadFile("/proc/self/mountinfo")
	for line := range strings.SplitSeq(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			points = append(points, f[4])
		}
	}
	slices.Reverse(points)
	for _, p := range points {
		unix.Unmount(p, unix.MNT_DETACH)
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// wantCode fails t unless err carries code.
func wantCode(t testing.TB, what string, err error, code errcode.Code) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: succeeded, want %s", what, code)
	}
	if got := errcode.Of(err); got != code {
		t.Fatalf("%s: %v (%s), want %s", what, err, got, code)
	}
}

// noMountsIn fails t if anything is mounted at or below dir.
func noMountsIn(t testing.TB, dir string) {
	t.Helper()
	if m := mountsBelow(t, dir); len(m) > 0 {
		t.Fatalf("mounted below %s: %q", dir, m)
	}
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return !errors.Is(err, os.ErrNotExist)
}
