package agent

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/internal/testing/guard"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// A restore through the agent reads a memory-file image's device state
// from the node only out of the RAM cache of the VM's own namespace, for
// an image prepared there from the repository the restore names. The
// tenant's QEMU reports its mem-path, and says what it likes: these tests
// make it name another tenant's files and files made to hang or flood the
// agent.

const localTestRAM = 4 << 20

// localTenants is an agent whose layout root holds an image of tenant-a
// and one of tenant-b, each with its device state.
type localTenants struct {
	s              *Server
	res            *staticResolver
	root, stateDir string
	imgA, imgB     string
	stateA, stateB []byte
	targets        int
}

func newLocalTenants(t *testing.T) *localTenants {
	lt := &localTenants{root: t.TempDir(), stateDir: t.TempDir(), res: newStaticResolver()}
	lt.imgA, _, lt.stateA = memoryFileImageState(t, filepath.Join(lt.root, "tenant-a", "vms"), localTestRAM)
	lt.imgB, _, lt.stateB = memoryFileImageState(t, filepath.Join(lt.root, "tenant-b", "vms"), localTestRAM)
	s, err := New(context.Background(), Config{StateDir: lt.stateDir, Resolver: lt.res, LayoutRoot: lt.root, MaxConcurrent: 2,
		OperationTimeout: 2 * time.Minute, AdminNamespaces: []string{"platform"}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	lt.s = s
	return lt
}

// target is a fake QEMU of a pod of namespace ns, waiting with -incoming
// defer for a memory-file image whose device state is state (it loads that
// and fails on anything else), whose RAM backend reports memPath.
func (lt *localTenants) target(t *testing.T, ns string, state []byte, memPath string) (string, *qmptest.FakeQEMU) {
	q := qmptest.NewFakeQEMU(t, "inmigrate", state)
	q.Memory = localTestRAM
	q.Caps["x-ignore-shared"] = false
	q.RAMBackend = &qmptest.FakeBackend{ID: "ram0", Type: "memory-backend-file", MemPath: memPath}
	lt.targets++
	uid := strings.Replace(uid1, "1111", strings.Repeat(string(rune('a'+lt.targets)), 4), 1)
	lt.res.mu.Lock()
	lt.res.vms[uid] = api.Target{PodUID: uid, Container: "qemu", ContainerID: "c-" + uid, QMPPath: q.Path(), Namespace: ns}
	lt.res.mu.Unlock()
	return uid, q
}

// restore asks, as caller, for a restore of image into the VM of pod uid
// and waits for its end: a minute at most (internal/testing/guard), whatever the agent
// opened.
func (lt *localTenants) restore(t *testing.T, caller Caller, uid, image string) api.Operation {
	t.Helper()
	o, err := lt.s.StartRestore(withCaller(context.Background(), caller), api.RestoreRequest{
		VM: api.VMRef{PodUID: uid, Container: "qemu", QMPPath: "/run/vm/qmp.sock"}, Image: image})
	if err != nil {
		t.Fatalf("the restore request: %v", err)
	}
	return guard.Within(t, time.Minute, 1<<30, "the agent's restore", func() api.Operation {
		for {
			op, err := lt.s.ops.get(o.ID)
			if err == nil && op.ended() {
				return op.snapshot()
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
}

func digestOf(image string) string { return image[strings.LastIndex(image, "@")+1:] }

// Tenant A names, under its own layout, tenant B's digest, and its QEMU
// reports as its RAM file B's prepared file: in the agent's cache of
// tenant-b, or in B's pod volume, where B's own init container prepared
// it. A gets nothing of B's; its own prepared image comes from the node.
func TestAgentRestoreReadsOnlyTheCacheOfTheVMsNamespace(t *testing.T) {
	lt := newLocalTenants(t)
	ctx := context.Background()
	inCache, err := lt.s.prepareAndWait(withCaller(ctx, callerB), api.PrepareRequest{Image: lt.imgB})
	if err != nil {
		t.Fatal(err)
	}
	podVolume := t.TempDir()
	if err := os.Chmod(podVolume, 0o777); err != nil { // an emptyDir's root
		t.Fatal(err)
	}
	inPod, err := snapshot.Prepare(ctx, snapshot.PrepareSpec{Image: lt.imgB, CacheDir: filepath.Join(podVolume, "cache"), PrivateParent: true})
	if err != nil {
		t.Fatal(err)
	}
	stolen := "oci:" + filepath.Join(lt.root, "tenant-a", "vms") + "@" + digestOf(lt.imgB)
	for where, memPath := range map[string]string{"tenant-b's cache": inCache.MemoryFile, "tenant-b's pod volume": inPod.MemoryFile} {
		t.Run(where, func(t *testing.T) {
			uid, q := lt.target(t, "tenant-a", lt.stateA, memPath)
			op := lt.restore(t, callerA, uid, stolen)
			if len(q.Received) != 0 || slices.Contains(q.Commands(), "migrate-incoming") || bytes.Contains(q.Received, lt.stateB[:4096]) {
				t.Fatalf("tenant-b's device state reached tenant-a's QEMU (%d bytes)", len(q.Received))
			}
			if op.State != api.StateFailed || op.Error == nil || op.Error.Code != errcode.RegistryError {
				t.Fatalf("tenant-a restoring tenant-b's digest from its own layout: %s %+v %+v; want failed, REGISTRY_ERROR", op.State, op.Error, op.Restore)
			}
		})
	}

	// Tenant A's own image, prepared in its namespace's cache: from the
	// node, its layout untouched.
	mine, err := lt.s.prepareAndWait(withCaller(ctx, callerA), api.PrepareRequest{Image: lt.imgA})
	if err != nil {
		t.Fatal(err)
	}
	uid, q := lt.target(t, "tenant-a", lt.stateA, mine.MemoryFile)
	op := lt.restore(t, callerA, uid, lt.imgA)
	if op.State != api.StateSucceeded || op.Restore == nil || !op.Restore.VMState.FromNode || !q.Caps["x-ignore-shared"] {
		t.Fatalf("tenant-a's own prepared image: %s %+v %+v; want it loaded from the node", op.State, op.Error, op.Restore)
	}
}

// Tenant A's QEMU reports a mem-path in its own volume, beside which it
// made a *.state directory whose oci-layout is a FIFO (an open blocks for
// good, holding the agent's slot past --operation-timeout) or a link to
// /dev/zero (a read without end takes the agent down): the agent looks at
// neither, and loads A's image from A's layout.
func TestAgentRestoreIgnoresATenantsStateDirectory(t *testing.T) {
	lt := newLocalTenants(t)
	for name, plant := range map[string]func(string) error{
		"FIFO":         func(p string) error { return unix.Mkfifo(p, 0o600) },
		"link to zero": func(p string) error { return os.Symlink("/dev/zero", p) },
	} {
		t.Run(name, func(t *testing.T) {
			vol := t.TempDir()
			d := strings.TrimPrefix(digestOf(lt.imgA), "sha256:")
			ram := filepath.Join(vol, "sha256-"+d+".ram")
			if err := os.WriteFile(ram, make([]byte, localTestRAM), 0o600); err != nil {
				t.Fatal(err)
			}
			layout := filepath.Join(vol, "sha256-"+d+".state", "oci-layout")
			if err := os.Mkdir(filepath.Dir(layout), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := plant(layout); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if fd, err := unix.Open(layout, unix.O_WRONLY|unix.O_NONBLOCK, 0); err == nil {
					unix.Close(fd) // lets an open blocked on the FIFO go on
				}
			})
			uid, q := lt.target(t, "tenant-a", lt.stateA, ram)
			op := lt.restore(t, callerA, uid, lt.imgA)
			if op.State != api.StateSucceeded || op.Restore.VMState.FromNode || !bytes.Contains(q.Received, lt.stateA[:4096]) {
				t.Fatalf("%s %+v %+v; want tenant-a's image loaded from its layout", op.State, op.Error, op.Restore)
			}
		})
	}
}
