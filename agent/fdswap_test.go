package agent_test

// Attacks by a pod on the files the agent opens in its volume, against a
// real containerd and runc containers labelled as the kubelet labels them,
// and the agent's real resolver (agent/containerd): whatever the pod does
// with its paths once they were resolved, the agent reads and dials only
// what it resolved, and nothing of the node's layout reaches an image.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/agent/containerd"
	"github.com/vmsnap/vmsnap/internal/errcode"
	testcontainerd "github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
	"github.com/vmsnap/vmsnap/vmstate/disk"
)

// tenant is a pod whose QEMU container has a volume (HostDir, at /run/vm)
// holding a fake QEMU's QMP socket and a qcow2 overlay of its own.
type tenant struct {
	uid     string
	c       *testcontainerd.Container
	vm      *qmptest.FakeQEMU
	sock    string // host paths
	overlay string
	disk    []byte // the overlay's bytes
}

func newTenant(t *testing.T, d *testcontainerd.Daemon, hostDir, name string) *tenant {
	t.Helper()
	p := &tenant{uid: testcontainerd.NewPodUID()}
	p.c = d.Create(t, testcontainerd.PodContainer{PodUID: p.uid, HostDir: hostDir})
	state := make([]byte, 1<<20)
	rand.Read(state)
	p.vm = qmptest.NewFakeQEMU(t, "running", state)
	// The fake listens in a directory of its own: a listening socket
	// moved into the volume is still the same socket.
	p.sock = filepath.Join(p.c.HostDir, "qmp.sock")
	if err := os.Rename(p.vm.Path(), p.sock); err != nil {
		t.Fatal(err)
	}
	p.overlay = guest.NewDisk(t, p.c.HostDir)
	// Each tenant's overlay ends in bytes of its own, to be told apart.
	f, err := os.OpenFile(p.overlay, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Write(bytes.Repeat([]byte(name+" secret "), 4096))
	f.Close()
	if p.disk, err = os.ReadFile(p.overlay); err != nil {
		t.Fatal(err)
	}
	return p
}

func (p *tenant) ref() api.VMRef {
	return api.VMRef{PodUID: p.uid, Container: "qemu", QMPPath: "/run/vm/qmp.sock", DiskPath: "/run/vm/overlay.qcow2"}
}

// startAgent runs an agent with the containerd resolver.
func startAgent(t *testing.T, d *testcontainerd.Daemon) *agent.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	r, err := containerd.New(ctx, d.Address, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return agent.StartTestAgent(t, r)
}

// checkpoint runs req through the agent and returns the operation's end.
func checkpoint(t *testing.T, c *agent.Client, req api.CheckpointRequest) (api.Operation, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	op, err := c.Checkpoint(ctx, req)
	if err != nil {
		return op, err
	}
	op, err = c.Wait(ctx, op.ID, nil)
	if err != nil {
		t.Fatal(err)
	}
	return op, nil
}

// storedDisk is the overlay a disk image holds, decoded.
func storedDisk(t *testing.T, image string) []byte {
	t.Helper()
	ctx := context.Background()
	ref, err := ociimage.ParseReference(image)
	if err != nil {
		t.Fatal(err)
	}
	repo, err := ociimage.Open(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	_, m, _, err := disk.LoadDiskConfig(ctx, repo)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if _, err := chunk.DecodeStream(ctx, m.Layers, repo, &buf, chunk.StreamOptions{}); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// swapForLink replaces path with a symbolic link to target, atomically,
// keeping the file that was there at path+".orig".
func swapForLink(t *testing.T, path, target string) {
	if err := os.Symlink(target, path+".link"); err != nil {
		t.Error(err)
	}
	if err := os.Rename(path, path+".orig"); err != nil {
		t.Error(err)
	}
	if err := os.Rename(path+".link", path); err != nil {
		t.Error(err)
	}
}

// TestAgentDiskSwappedBeforeCapture: the pod swaps its overlay for a link
// to another tenant's overlay while its VM is stopped, just before the
// overlay is read (the moment a hostile QEMU knows its migration stream has
// ended). The image holds the pod's own overlay, and none of the manifests
// or configs pushed holds a host path.
func TestAgentDiskSwappedBeforeCapture(t *testing.T) {
	d := testcontainerd.Start(t)
	a, b := newTenant(t, d, "", "tenant-a"), newTenant(t, d, "", "tenant-b")
	c := startAgent(t, d)
	var swapped atomic.Int32
	agent.SetBeforeDiskCapture(t, func() {
		swapForLink(t, a.overlay, b.overlay)
		swapped.Add(1)
	})
	store := t.TempDir()
	op, err := checkpoint(t, c, api.CheckpointRequest{VM: a.ref(), Image: "oci:" + store + ":vm", DiskImage: "oci:" + store + ":disk", Mode: "pause"})
	if err != nil || op.State != api.StateSucceeded {
		t.Fatalf("checkpoint: %v, %+v", err, op.Error)
	}
	if swapped.Load() != 1 {
		t.Fatalf("the swap ran %d times", swapped.Load())
	}
	if fi, err := os.Lstat(a.overlay); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Fatalf("the overlay's path is not the link (%v, %v)", fi, err)
	}
	got := storedDisk(t, op.Checkpoint.Disk.Image)
	if bytes.Contains(got, []byte("tenant-b")) || !bytes.Equal(got, a.disk) {
		t.Fatalf("the disk image holds %d bytes, not the pod's own overlay (%d bytes); another tenant's: %v",
			len(got), len(a.disk), bytes.Contains(got, []byte("tenant-b")))
	}
	if p := op.Checkpoint.Disk.Path; p != "/run/vm/overlay.qcow2" {
		t.Errorf("the result names the overlay %q, want its path in the container", p)
	}
	checkNoHostPaths(t, store, "/run/vm/overlay.qcow2", a.c.HostDir, b.c.HostDir, d.Dir)
}

// checkNoHostPaths fails if a manifest, config or index in the layout at
// dir holds any of hosts, and unless the disk manifest's path annotation
// is want.
func checkNoHostPaths(t *testing.T, dir, want string, hosts ...string) {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(dir, "blobs", "sha256", "*"))
	files = append(files, filepath.Join(dir, "index.json"))
	found := false
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var doc struct {
			Annotations map[string]string `json:"annotations"`
		}
		if json.Unmarshal(b, &doc) != nil {
			continue // a chunk, compressed
		}
		for _, h := range hosts {
			if h != "" && bytes.Contains(b, []byte(h)) {
				t.Errorf("%s holds the host path %s:\n%s", filepath.Base(f), h, b)
			}
		}
		if p, ok := doc.Annotations[ociimage.AnnotationDiskPath]; ok {
			found = true
			if p != want {
				t.Errorf("%s = %q, want %q", ociimage.AnnotationDiskPath, p, want)
			}
		}
	}
	if !found {
		t.Errorf("no manifest carries %s", ociimage.AnnotationDiskPath)
	}
}

// TestAgentDiskSwapRace: the pod keeps swapping its overlay for a link to
// another tenant's and back while checkpoints run. Each either fails
// cleanly (the link was there when the VM was resolved) or stores the
// pod's own overlay: never the other tenant's bytes (the old code opened
// the path twice, for the header and then for the data).
func TestAgentDiskSwapRace(t *testing.T) {
	d := testcontainerd.Start(t)
	a, b := newTenant(t, d, "", "tenant-a"), newTenant(t, d, "", "tenant-b")
	c := startAgent(t, d)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			os.Symlink(b.overlay, a.overlay+".link")
			os.Rename(a.overlay, a.overlay+".orig")
			os.Rename(a.overlay+".link", a.overlay)
			time.Sleep(time.Duration(i%5) * 100 * time.Microsecond)
			os.Rename(a.overlay+".orig", a.overlay)
			time.Sleep(time.Duration(i%3) * 200 * time.Microsecond)
		}
	}()
	store := t.TempDir()
	var ok, refused int
	for i := 0; i < 16; i++ {
		op, err := checkpoint(t, c, api.CheckpointRequest{VM: a.ref(), Image: "oci:" + store + ":vm", DiskImage: "oci:" + store + ":disk", Mode: "snapshot"})
		switch {
		case err != nil:
			if code := errcode.Of(err); code != errcode.InvalidInput && code != errcode.VMNotFound {
				t.Fatalf("checkpoint %d refused with %s: %v", i, code, err)
			}
			refused++
		case op.State != api.StateSucceeded:
			t.Fatalf("checkpoint %d: %s, %+v", i, op.State, op.Error)
		default:
			ok++
			if got := storedDisk(t, op.Checkpoint.Disk.Image); !bytes.Equal(got, a.disk) {
				t.Fatalf("checkpoint %d stored %d bytes that are not the pod's overlay (another tenant's: %v)", i, len(got), bytes.Contains(got, []byte("tenant-b")))
			}
		}
		if st := a.vm.Status(); st != "running" {
			t.Fatalf("after checkpoint %d the VM is %s", i, st)
		}
	}
	close(stop)
	wg.Wait()
	t.Logf("%d checkpoints stored the pod's own overlay, %d were refused at resolve", ok, refused)
	if ok == 0 {
		t.Fatal("no checkpoint got through: the race was never run")
	}
}

// TestAgentQMPSwappedAfterResolve: once the VM is resolved, the pod swaps
// its QMP socket for a link to another tenant's socket, for that socket
// itself (moved into its volume), or for a bind mount of it. The agent
// stops and checkpoints the pod's own QEMU; the other tenant's QEMU never
// sees a command.
func TestAgentQMPSwappedAfterResolve(t *testing.T) {
	d := testcontainerd.Start(t)
	c := startAgent(t, d)
	for _, tc := range []struct {
		name string
		swap func(t *testing.T, own, other string)
	}{
		{"symbolic link", func(t *testing.T, own, other string) { swapForLink(t, own, other) }},
		{"socket moved in", func(t *testing.T, own, other string) {
			if err := os.Rename(other, own); err != nil {
				t.Error(err)
			}
		}},
		{"bind mount", func(t *testing.T, own, other string) {
			if err := unix.Mount(other, own, "", unix.MS_BIND, ""); err != nil {
				t.Error(err)
				return
			}
			t.Cleanup(func() { unix.Unmount(own, unix.MNT_DETACH) })
		}},
	} {
		// Under the agent's layout root: the parent test's temporary directory.
		store := filepath.Join(t.TempDir(), "store")
		t.Run(tc.name, func(t *testing.T) {
			a, b := newTenant(t, d, "", "tenant-a"), newTenant(t, d, "", "tenant-b")
			agent.SetAfterResolve(t, func() { tc.swap(t, a.sock, b.sock) })
			op, err := checkpoint(t, c, api.CheckpointRequest{VM: api.VMRef{PodUID: a.uid, Container: "qemu", QMPPath: "/run/vm/qmp.sock"},
				Image: "oci:" + store + ":vm", Mode: "pause"})
			if err != nil || op.State != api.StateSucceeded {
				t.Fatalf("checkpoint: %v, %+v", err, op.Error)
			}
			if got := b.vm.Srv.Received(); len(got) != 0 || b.vm.Status() != "running" {
				var names []string
				for _, c := range got {
					names = append(names, c.Execute)
				}
				t.Fatalf("the other tenant's QEMU is %s and received %v", b.vm.Status(), names)
			}
			if !migrated(a.vm) || a.vm.Status() == "running" {
				t.Fatalf("the pod's own QEMU is %s: it was not the one checkpointed", a.vm.Status())
			}
		})
	}
}

// migrated reports whether vm was asked to migrate (its state stored).
func migrated(vm *qmptest.FakeQEMU) bool {
	return slices.ContainsFunc(vm.Srv.Received(), func(c qmptest.Command) bool { return c.Execute == "migrate" })
}

// TestAgentQMPSocketBeyondAddressLimit: a QMP socket whose host path is
// longer than a unix socket address holds (107 bytes; a pod's volume on a
// node with a long kubelet root) is reached through the agent.
func TestAgentQMPSocketBeyondAddressLimit(t *testing.T) {
	d := testcontainerd.Start(t)
	deep := filepath.Join(t.TempDir(), "kubelet", strings.Repeat("p", 60), "volumes", "kubernetes.io~empty-dir", strings.Repeat("v", 40))
	if err := os.MkdirAll(deep, 0o755); err != nil {
		t.Fatal(err)
	}
	a := newTenant(t, d, deep, "tenant-a")
	if len(a.sock) <= 107 {
		t.Fatalf("the socket's path is %d bytes: not beyond the limit", len(a.sock))
	}
	if _, err := net.Dial("unix", a.sock); err == nil || !errors.Is(err, unix.EINVAL) {
		t.Fatalf("dialing the %d-byte path by name: %v; want EINVAL (else this test proves nothing)", len(a.sock), err)
	}
	c := startAgent(t, d)
	store := t.TempDir()
	op, err := checkpoint(t, c, api.CheckpointRequest{VM: a.ref(), Image: "oci:" + store + ":vm", DiskImage: "oci:" + store + ":disk", Mode: "pause"})
	if err != nil || op.State != api.StateSucceeded {
		t.Fatalf("checkpoint of a VM whose socket path is %d bytes: %v, %+v", len(a.sock), err, op.Error)
	}
	if !migrated(a.vm) || op.Checkpoint.VMState.RawBytes != int64(len(a.vm.State)) {
		t.Fatalf("VM %s, state of %d bytes", a.vm.Status(), op.Checkpoint.VMState.RawBytes)
	}
}

// TestAgentSwapsAgainstRealQEMU: the same two swaps with real guests. Once
// its VM is resolved, pod A swaps its QMP socket for a link to pod B's and,
// while its VM is stopped, its overlay for a link to B's. The agent stops
// and checkpoints A's guest and stores A's overlay; B's guest never stops.
func TestAgentSwapsAgainstRealQEMU(t *testing.T) {
	d := testcontainerd.Start(t)
	guest.Assets(t)
	type pod struct {
		dir, overlay, monitor string
		vm                    *guest.VM
		uid                   string
	}
	start := func() *pod {
		p := &pod{dir: guest.FreeShortDir(t), uid: testcontainerd.NewPodUID()}
		p.overlay = guest.NewDisk(t, p.dir)
		p.monitor = filepath.Join(p.dir, "test-mon.sock")
		p.vm = guest.Start(t, guest.Options{Dir: p.dir, Disk: p.overlay,
			ExtraArgs: []string{"-qmp", "unix:" + p.monitor + ",server=on,wait=off"}})
		d.Create(t, testcontainerd.PodContainer{PodUID: p.uid, HostDir: p.dir})
		return p
	}
	a, b := start(), start()
	f, err := os.OpenFile(b.overlay, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Write(bytes.Repeat([]byte("tenant-b secret "), 4096)) // QEMU ignores bytes past its tables
	f.Close()
	for _, p := range []*pod{a, b} {
		if _, err := p.vm.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter >= 1 }); err != nil {
			t.Fatal(err)
		}
	}
	c := startAgent(t, d)
	agent.SetAfterResolve(t, func() { swapForLink(t, a.vm.QMPPath(), b.vm.QMPPath()) })
	agent.SetBeforeDiskCapture(t, func() { swapForLink(t, a.overlay, b.overlay) })
	store := t.TempDir()
	op, err := checkpoint(t, c, api.CheckpointRequest{
		VM:    api.VMRef{PodUID: a.uid, Container: "qemu", QMPPath: "/run/vm/" + filepath.Base(a.vm.QMPPath()), DiskPath: "/run/vm/overlay.qcow2"},
		Image: "oci:" + store + ":vm", DiskImage: "oci:" + store + ":disk", Mode: "pause"})
	if err != nil || op.State != api.StateSucceeded {
		t.Fatalf("checkpoint: %v, %+v", err, op.Error)
	}
	if st := qmpStatus(t, b.monitor); st != "running" {
		t.Fatalf("pod B's guest is %s: the agent reached it through A's swapped socket", st)
	}
	last, _ := b.vm.LastStatus()
	if _, err := b.vm.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > last.Counter }); err != nil {
		t.Fatalf("pod B's guest does not count on: %v", err)
	}
	if st := qmpStatus(t, a.monitor); st == "running" {
		t.Fatalf("pod A's guest is %s after a pause-mode checkpoint: it was not the one checkpointed", st)
	}
	own, err := os.ReadFile(a.overlay + ".orig") // A's overlay, its guest stopped since the capture
	if err != nil {
		t.Fatal(err)
	}
	if got := storedDisk(t, op.Checkpoint.Disk.Image); !bytes.Equal(got, own) || bytes.Contains(got, []byte("tenant-b")) {
		t.Fatalf("the disk image holds %d bytes, not pod A's overlay (%d bytes)", len(got), len(own))
	}
}

// hangGuard bounds the waits of the tests on real guests: it catches a hang,
// never a slow machine (two TCG guests booting beside other work on two
// loaded cores take minutes, not the seconds they take on a quiet one).
const hangGuard = 5 * time.Minute

func waitCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	t.Cleanup(cancel)
	return ctx
}

// qmpStatus is a guest's run state, asked on the test's own monitor.
func qmpStatus(t *testing.T, monitor string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	raw, err := guest.QMP(ctx, monitor, "query-status", nil)
	if err != nil {
		t.Fatalf("query-status on %s: %v", monitor, err)
	}
	var st struct{ Status string }
	json.Unmarshal(raw, &st)
	return st.Status
}
