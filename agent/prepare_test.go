package agent

import (
	"bytes"
	"context"
	"crypto/rand"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
	"github.com/vmsnap/vmsnap/vmstate"
)

// memoryFileImage checkpoints a fake QEMU whose RAM is a shared file of
// size bytes into the layout dir and returns the image (REF@sha256) and
// the RAM file's bytes.
func memoryFileImage(t *testing.T, dir string, size int, store ...ociimage.Option) (string, []byte) {
	t.Helper()
	img, ram, _ := memoryFileImageState(t, dir, size, store...)
	return img, ram
}

// memoryFileImageState is memoryFileImage, and the fake's device state.
func memoryFileImageState(t *testing.T, dir string, size int, store ...ociimage.Option) (string, []byte, []byte) {
	t.Helper()
	return memoryFileCheckpoint(t, "oci:"+dir+":vm", [3]int{}, size, store...)
}

// memoryFileCheckpoint checkpoints a fake QEMU of version qemu (the fake's
// default when zero) whose RAM is a shared file of size bytes to image.
func memoryFileCheckpoint(t *testing.T, image string, qemu [3]int, size int, store ...ociimage.Option) (string, []byte, []byte) {
	t.Helper()
	ram := make([]byte, size)
	rand.Read(ram[:size/4])
	ramPath := filepath.Join(t.TempDir(), "guest.ram")
	if err := os.WriteFile(ramPath, ram, 0o600); err != nil {
		t.Fatal(err)
	}
	qmptest.MapFile(t, ramPath) // as QEMU does: vmsnap reads only a file its QEMU maps
	state := make([]byte, 32<<10)
	rand.Read(state)
	vm := qmptest.NewFakeQEMU(t, "running", state)
	if qemu != [3]int{} {
		vm.Version = qemu
	}
	vm.Memory = int64(size)
	vm.RAMBackend = &qmptest.FakeBackend{ID: "ram0", Type: "memory-backend-file", MemPath: ramPath, Share: true}
	vm.Caps["x-ignore-shared"] = false
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := snapshot.Checkpoint(ctx, snapshot.CheckpointSpec{QMPPath: vm.Path(), Image: image, Mode: "snapshot", Store: store})
	if err != nil {
		t.Fatal(err)
	}
	if res.VMState.Format != "memory-file" {
		t.Fatalf("format %s", res.VMState.Format)
	}
	return res.VMState.Image, ram, state
}

// prepareVia runs a prepare through the client, as the CLI does.
func prepareVia(ctx context.Context, c *Client, req api.PrepareRequest) (*api.PrepareResult, error) {
	o, err := c.Prepare(ctx, req)
	if err != nil {
		return nil, err
	}
	if o, err = c.Wait(ctx, o.ID, nil); err != nil {
		return nil, err
	}
	return o.Prepare, Result(o)
}

// The agent prepares into the cache of the caller's namespace, only what
// its policy allows, and names the file as the pod's QEMU sees it.
func TestAgentPrepare(t *testing.T) {
	root := t.TempDir() // the layout root, the agent's alone
	imgA, ramA := memoryFileImage(t, filepath.Join(root, "tenant-a", "vms"), 4<<20)
	imgB, _ := memoryFileImage(t, filepath.Join(root, "tenant-b", "vms"), 4<<20)
	stateDir := t.TempDir()
	ta := startAgentConfig(t, Config{StateDir: stateDir, Resolver: newStaticResolver(), LayoutRoot: root, AdminNamespaces: []string{"platform"}})
	s := ta.srv
	ctx := func(c Caller) context.Context { return withCaller(context.Background(), c) }

	res, err := s.prepareAndWait(ctx(callerA), api.PrepareRequest{Image: imgA, QEMUDir: "/vm/ram"})
	if err != nil {
		t.Fatal(err)
	}
	cacheA := filepath.Join(stateDir, "ram", "tenant-a")
	host := filepath.Join(cacheA, filepath.Base(res.MemoryFile))
	if got, err := os.ReadFile(host); err != nil || !bytes.Equal(got, ramA) {
		t.Fatalf("the RAM file in tenant-a's cache (%s): %d bytes, %v; want the guest's %d", host, len(got), err, len(ramA))
	}
	if !strings.HasPrefix(res.MemoryFile, "/vm/ram/sha256-") {
		t.Errorf("memoryFile %s: want it as QEMU sees it, under /vm/ram", res.MemoryFile)
	}
	if !slices.ContainsFunc(res.QEMUArgs, func(a string) bool {
		return strings.Contains(a, "mem-path="+res.MemoryFile+",") && strings.Contains(a, "share=off")
	}) {
		t.Errorf("qemuArgs %q do not map %s private", res.QEMUArgs, res.MemoryFile)
	}
	if strings.Contains(strings.Join(res.QEMUArgs, " ")+res.MemoryFile, stateDir) {
		t.Errorf("the result names the node's path: %+v", res)
	}
	if res.FetchedBytes == 0 {
		t.Error("the first prepare fetched nothing")
	}
	// Again, named by its checkpoint (the index the tag names): the same
	// state image, so the cached file.
	index := "oci:" + filepath.Join(root, "tenant-a", "vms") + ":vm"
	again, err := s.prepareAndWait(ctx(callerA), api.PrepareRequest{Image: index, AllowTag: true, QEMUDir: "/vm/ram"})
	if err != nil || again.FetchedBytes != 0 || again.Image != imgA || !strings.HasPrefix(again.Checkpoint, "oci:"+filepath.Join(root, "tenant-a", "vms")+"@sha256:") {
		t.Errorf("the second prepare, through the checkpoint: %+v, %v; want the cached file of %s, nothing fetched", again, err, imgA)
	}
	// The same image for tenant-b (an admin asks for it): its own copy,
	// in its own cache, never tenant-a's file.
	if res, err := s.prepareAndWait(ctx(callerAdmin), api.PrepareRequest{Image: imgA, Namespace: "tenant-b"}); err != nil || res.FetchedBytes == 0 ||
		!strings.HasPrefix(res.MemoryFile, filepath.Join(stateDir, "ram", "tenant-b")+"/") {
		t.Errorf("an admin for tenant-b: %+v, %v; want a file of tenant-b's cache, fetched", res, err)
	}
	if fi, err := os.Stat(cacheA); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("tenant-a's cache: %v, %v; want a directory of mode 0700", fi, err)
	}

	for _, tc := range []struct {
		name string
		c    Caller
		req  api.PrepareRequest
		code errcode.Code
	}{
		{"another tenant's layout", callerA, api.PrepareRequest{Image: imgB}, errcode.Forbidden},
		{"another tenant's cache", callerA, api.PrepareRequest{Image: imgA, Namespace: "tenant-b"}, errcode.Forbidden},
		{"a namespace that is a path", callerAdmin, api.PrepareRequest{Image: imgA, Namespace: "../../etc"}, errcode.InvalidInput},
		{"a namespace that is a path, as a tenant", callerA, api.PrepareRequest{Image: imgA, Namespace: "../tenant-b"}, errcode.InvalidInput},
		{"a registry not allowed", callerA, api.PrepareRequest{Image: "reg.example/vms/x@sha256:" + strings.Repeat("ab", 32)}, errcode.Forbidden},
		{"a layout outside the root", callerA, api.PrepareRequest{Image: "oci:/etc@sha256:" + strings.Repeat("ab", 32)}, errcode.Forbidden},
		{"a tag", callerA, api.PrepareRequest{Image: strings.Split(imgA, "@")[0]}, errcode.TagNotAllowed},
		{"a relative qemuDir", callerA, api.PrepareRequest{Image: imgA, QEMUDir: "vm/ram"}, errcode.InvalidInput},
		{"a qemuDir with ..", callerA, api.PrepareRequest{Image: imgA, QEMUDir: "/vm/../etc"}, errcode.InvalidInput},
		{"a huge qemuDir", callerA, api.PrepareRequest{Image: imgA, QEMUDir: "/" + strings.Repeat("a", 5000)}, errcode.InvalidInput},
		{"too many workers", callerA, api.PrepareRequest{Image: imgA, Workers: 1000}, errcode.InvalidInput},
		{"no image", callerA, api.PrepareRequest{}, errcode.Usage},
		{"a node process without a namespace", Caller{Admin: true, PID: 1}, api.PrepareRequest{Image: imgA}, errcode.Usage},
	} {
		if res, err := s.prepareAndWait(ctx(tc.c), tc.req); errcode.Of(err) != tc.code {
			t.Errorf("%s: %+v, %v; want %s", tc.name, res, err, tc.code)
		}
	}
	if _, err := os.Stat(filepath.Join(stateDir, "ram", "etc")); err == nil {
		t.Error("a cache directory was made for a namespace that is a path")
	}
	// Nothing of tenant-b's layout reached tenant-a's cache: one RAM file
	// (beside it are its lock and its device state).
	ents, _ := os.ReadDir(cacheA)
	var names []string
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".ram") {
			names = append(names, e.Name())
		}
	}
	if len(names) != 1 {
		t.Errorf("tenant-a's cache holds %v, want its one file", names)
	}
}

// Through the HTTP API and the client, with the cache bounded: the bound
// evicts the least recently used file of the namespace.
func TestAgentPrepareOverHTTPEvicts(t *testing.T) {
	root := t.TempDir()
	img1, _ := memoryFileImage(t, filepath.Join(root, "one"), 4<<20)
	img2, _ := memoryFileImage(t, filepath.Join(root, "two"), 4<<20)
	stateDir := t.TempDir()
	ta := startAgentConfig(t, Config{StateDir: stateDir, Resolver: newStaticResolver(), LayoutRoot: root, RAMCacheMaxBytes: 1 << 20})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// The test process is on the node: an admin, which names the namespace.
	if _, err := prepareVia(ctx, ta.client, api.PrepareRequest{Image: img1}); errcode.Of(err) != errcode.Usage {
		t.Fatalf("a node process without a namespace: %v, want USAGE", err)
	}
	r1, err := prepareVia(ctx, ta.client, api.PrepareRequest{Image: img1, Namespace: "tenant-a"})
	if err != nil {
		t.Fatal(err)
	}
	r2, err := prepareVia(ctx, ta.client, api.PrepareRequest{Image: img2, Namespace: "tenant-a"})
	if err != nil {
		t.Fatal(err)
	}
	if len(r2.Evicted) != 1 || r2.Evicted[0] != r1.Digest {
		t.Errorf("evicted %v, want the first image's file %s", r2.Evicted, r1.Digest)
	}
	if _, err := os.Stat(r1.MemoryFile); err == nil {
		t.Error("the evicted file is still there")
	}
	if _, err := os.Stat(r2.MemoryFile); err != nil {
		t.Errorf("the file just prepared: %v", err)
	}
	if _, err := New(context.Background(), Config{StateDir: t.TempDir(), Resolver: newStaticResolver(), RAMCacheMaxBytes: -1}); errcode.Of(err) != errcode.Usage {
		t.Errorf("a negative --ram-cache-max-bytes: %v, want USAGE", err)
	}
}

// The agent's --max-guest-memory refuses a prepare of an image declaring
// more, before a layer of it is fetched or a byte written to the cache; by
// default it is the node's memory.
func TestAgentPrepareRefusesMoreGuestMemoryThanTheNodeTakes(t *testing.T) {
	root := t.TempDir()
	img, _ := memoryFileImage(t, filepath.Join(root, "tenant-a", "vms"), 4<<20)
	stateDir := t.TempDir()
	ta := startAgentConfig(t, Config{StateDir: stateDir, Resolver: newStaticResolver(), LayoutRoot: root, MaxGuestMemory: 2 << 20})
	_, err := ta.srv.prepareAndWait(withCaller(context.Background(), callerA), api.PrepareRequest{Image: img})
	if errcode.Of(err) != errcode.InvalidInput || !strings.Contains(err.Error(), "maxGuestMemory") {
		t.Fatalf("a 4 MiB image under a 2 MiB bound: %v, want INVALID_INPUT naming maxGuestMemory", err)
	}
	if files, _ := filepath.Glob(filepath.Join(stateDir, "ram", "tenant-a", "*")); len(files) != 0 {
		t.Fatalf("the refused prepare left %v in the cache", files)
	}
	def := startAgentConfig(t, Config{StateDir: t.TempDir(), Resolver: newStaticResolver(), LayoutRoot: root})
	if got := def.srv.cfg.MaxGuestMemory; got != vmstate.DefaultMaxGuestMemory() || got <= 4<<20 {
		t.Fatalf("the default bound is %d, want the node's memory", got)
	}
}
