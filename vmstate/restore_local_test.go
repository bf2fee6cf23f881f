package vmstate

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/guard"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// A restore reads a memory-file image's device state from the node when
// the image was prepared there, in the caller's own RAM cache, from the
// very repository the restore names. It must never find it from what the
// target QEMU reports (its mem-path): the tenant's QEMU says what it likes.

// tenantImage is a memory-file image checkpointed from a fake VM into a
// layout of its own, prepared into cache: its reference by digest, and its
// device state.
type tenantImage struct {
	ref, layout string
	state       []byte
	prepared    *PrepareResult
}

func newTenantImage(t *testing.T, cache ramfile.Cache) tenantImage {
	t.Helper()
	q, _ := fakeFileVM(t)
	layout := t.TempDir()
	res, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+layout+":vm"), CheckpointOptions{Mode: ModePause, StagingDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	ref := "oci:" + layout + "@" + res.Manifest.Digest.String()
	p, err := Prepare(context.Background(), openLayout(t, ref), PrepareOptions{Cache: cache})
	if err != nil {
		t.Fatal(err)
	}
	return tenantImage{ref: ref, layout: layout, state: q.State, prepared: p}
}

// waitingTarget is a fake QEMU waiting for a memory-file image whose
// device state is state (it loads that and fails on anything else), whose
// RAM backend reports memPath.
func waitingTarget(t *testing.T, state []byte, memPath string) *qmptest.FakeQEMU {
	q := qmptest.NewFakeQEMU(t, "inmigrate", state)
	q.Memory = fakeRAM
	q.Caps[capIgnoreShared] = false
	q.RAMBackend = &qmptest.FakeBackend{ID: "ram0", Type: "memory-backend-file", MemPath: memPath}
	return q
}

// restoreWithin runs a restore, failing the test if it blocks and ending
// it if it reads without bound (internal/testing/guard).
func restoreWithin(t *testing.T, q *qmptest.FakeQEMU, ref string, opts RestoreOptions) (*RestoreResult, error) {
	t.Helper()
	type result struct {
		res *RestoreResult
		err error
	}
	mon, repo := q.Dial(t), openLayout(t, ref)
	r := guard.Within(t, time.Minute, 1<<30, "the restore", func() result {
		res, err := Restore(context.Background(), mon, repo, opts)
		return result{res, err}
	})
	return r.res, r.err
}

// Tenant A names an image under its own repository with tenant B's digest,
// and its QEMU reports as its RAM file B's prepared file, in another
// namespace's cache or in B's pod volume. A must not get B's state.
func TestRestoreNeverReadsTheStateBesideTheMemPathQEMUReports(t *testing.T) {
	// B's pod prepared into its own emptyDir, whose root is world-writable.
	podVolume := func(t *testing.T) ramfile.Cache {
		vol := t.TempDir()
		if err := os.Chmod(vol, 0o777); err != nil {
			t.Fatal(err)
		}
		return ramfile.Cache{Dir: filepath.Join(vol, "cache"), PrivateParent: true}
	}
	nodeCache := func(t *testing.T) ramfile.Cache {
		return ramfile.Cache{Dir: filepath.Join(t.TempDir(), "ram", "tenant-b")}
	}
	for where, cacheB := range map[string]func(*testing.T) ramfile.Cache{"another namespace's cache": nodeCache, "another pod's volume": podVolume} {
		t.Run(where, func(t *testing.T) {
			b := newTenantImage(t, cacheB(t))
			a := newTenantImage(t, ramfile.Cache{Dir: filepath.Join(t.TempDir(), "cache")})
			target := waitingTarget(t, a.state, b.prepared.MemoryFile)
			refB := "oci:" + a.layout + "@" + b.prepared.Manifest.Digest.String()
			cacheA := &ramfile.Cache{Dir: filepath.Dir(a.prepared.MemoryFile)}
			res, err := restoreWithin(t, target, refB, RestoreOptions{Cache: cacheA})
			if err == nil || (res != nil && res.FromNode) {
				t.Fatalf("tenant A restored tenant B's digest from its own repository: %+v, %v", res, err)
			}
			if bytes.Contains(target.Received, b.state[:4096]) || slices.Contains(target.Commands(), "migrate-incoming") {
				t.Fatalf("tenant B's device state reached tenant A's QEMU (%d bytes)", len(target.Received))
			}
			if errcode.Of(err) != errcode.RegistryError {
				t.Errorf("got %v, want REGISTRY_ERROR (no such manifest in A's repository)", err)
			}
		})
	}
}

// A tenant's QEMU reports a mem-path in its own volume, where it made a
// *.state directory whose oci-layout is a FIFO (an open for reading would
// block for good) or a link to /dev/zero (a read without end): the restore
// looks at neither, and loads A's own image from its store.
func TestRestoreIgnoresATenantsStateDirectory(t *testing.T) {
	for name, plant := range map[string]func(string) error{
		"FIFO":         func(p string) error { return unix.Mkfifo(p, 0o600) },
		"link to zero": func(p string) error { return os.Symlink("/dev/zero", p) },
	} {
		t.Run(name, func(t *testing.T) {
			a := newTenantImage(t, ramfile.Cache{Dir: filepath.Join(t.TempDir(), "cache")})
			vol := t.TempDir()
			ram := filepath.Join(vol, filepath.Base(a.prepared.MemoryFile))
			if err := os.WriteFile(ram, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			state := filepath.Join(vol, "sha256-"+a.prepared.Manifest.Digest.Encoded()+".state")
			if err := os.Mkdir(state, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := plant(filepath.Join(state, "oci-layout")); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unblockFIFO(filepath.Join(state, "oci-layout")) })
			target := waitingTarget(t, a.state, ram)
			res, err := restoreWithin(t, target, a.ref, RestoreOptions{})
			if err != nil {
				t.Fatalf("restoring A's own image: %v", err)
			}
			// The fake loads only A's device state.
			if res.FromNode || !res.VMRunning || !bytes.Contains(target.Received, a.state[:4096]) {
				t.Fatalf("from the node %v, running %v, %d bytes received: want A's state from its store", res.FromNode, res.VMRunning, len(target.Received))
			}
		})
	}
}

// unblockFIFO opens a FIFO for writing without blocking, which lets a
// reader blocked in open go on, and closes it.
func unblockFIFO(p string) {
	if fd, err := unix.Open(p, unix.O_WRONLY|unix.O_NONBLOCK, 0); err == nil {
		unix.Close(fd)
	}
}

// A target may map a VM's own copy shared, never the prepared cache file
// (the guest would write into the file every restore of the image maps):
// vmsnap tells by the file's device and inode in the QEMU's memory map,
// whatever name the QEMU reports (a link named as a copy).
func TestRestoreRefusesASharedMappingOfThePreparedFile(t *testing.T) {
	cache := ramfile.Cache{Dir: filepath.Join(t.TempDir(), "cache")}
	a := newTenantImage(t, cache)
	copyName := filepath.Join(t.TempDir(), "vm-1."+filepath.Base(a.prepared.MemoryFile))
	if err := os.Link(a.prepared.MemoryFile, copyName); err != nil {
		t.Fatal(err)
	}
	qmptest.MapFile(t, copyName) // shared, as share=on maps it (the fake QEMU runs in this process)
	target := waitingTarget(t, a.state, copyName)
	target.RAMBackend.Share = true
	_, err := restoreWithin(t, target, a.ref, RestoreOptions{Cache: &cache})
	if errcode.Of(err) != errcode.CompatMismatch || !strings.Contains(strings.Join(errcode.DetailsOf(err), "; "), "share=on") {
		t.Fatalf("a shared mapping of the prepared file, named as a copy: %v (%v); want COMPAT_MISMATCH", err, errcode.DetailsOf(err))
	}
	if len(target.Received) != 0 {
		t.Fatal("the refused target was fed")
	}
}

// The device state kept in the caller's cache serves a restore of the
// repository it was fetched from, and reads nothing from that store; the
// same digest named in another repository comes from that repository.
func TestRestoreReadsTheNodeOnlyForTheRepositoryItWasPreparedFrom(t *testing.T) {
	cache := ramfile.Cache{Dir: filepath.Join(t.TempDir(), "cache")}
	a := newTenantImage(t, cache)
	other := t.TempDir()
	d := a.prepared.Manifest.Digest
	if _, err := ociimage.Copy(context.Background(), openLayout(t, a.ref), openLayout(t, "oci:"+other+":vm"), 0, 2); err != nil {
		t.Fatal(err)
	}
	target := waitingTarget(t, a.state, a.prepared.MemoryFile)
	res, err := restoreWithin(t, target, "oci:"+other+"@"+d.String(), RestoreOptions{Cache: &cache})
	if err != nil || res.FromNode {
		t.Fatalf("the same digest in another repository: %+v, %v; want it loaded from that repository", res, err)
	}
	// The store is gone: the node has all the restore needs.
	if err := os.RemoveAll(a.layout); err != nil {
		t.Fatal(err)
	}
	target = waitingTarget(t, a.state, a.prepared.MemoryFile)
	res, err = restoreWithin(t, target, a.ref, RestoreOptions{Cache: &cache})
	if err != nil || !res.FromNode || !res.VMRunning {
		t.Fatalf("the prepared image, its store gone: %+v, %v; want it loaded from the node", res, err)
	}
}
