package agent

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	testcontainerd "github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
	"github.com/vmsnap/vmsnap/rootfs"
)

// ctrdResolver is the static resolver that can also capture a container's
// writable layer, through a real containerd (what agent/containerd does).
type ctrdResolver struct {
	*staticResolver
	client *containerd.Client
}

func (r *ctrdResolver) CaptureRootfs(ctx context.Context, t Target, repo ociimage.Repository, progress func(int64)) (*rootfs.LayerResult, error) {
	return rootfs.CaptureLayer(ctx, r.client, testcontainerd.Namespace, t.ContainerID, repo, rootfs.LayerOptions{Progress: progress})
}

// TestAgentCheckpointWithRootfsLayer: one checkpoint through the agent
// stores the VM state, the disk overlay and the container's writable layer,
// returns the three digests, and the state manifest names the other two.
func TestAgentCheckpointWithRootfsLayer(t *testing.T) {
	d := testcontainerd.Start(t)
	c := d.Create(t, testcontainerd.PodContainer{PodUID: uid1, Args: []string{"/bin/busybox", "sh", "-c",
		"echo launch > /launch.conf && echo ready > /run/vm/ready && exec sleep 3600"}})
	deadline := time.Now().Add(30 * time.Second)
	for _, err := os.Stat(filepath.Join(c.HostDir, "ready")); err != nil; _, err = os.Stat(filepath.Join(c.HostDir, "ready")) {
		if time.Now().After(deadline) {
			t.Fatal("the container did not start")
		}
		time.Sleep(20 * time.Millisecond)
	}
	overlay := guest.NewDisk(t, t.TempDir())
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20))
	res := &ctrdResolver{newStaticResolver(), d.Client}
	res.vms[uid1] = api.Target{PodUID: uid1, Container: "qemu", ContainerID: c.ID, QMPPath: vm.Path(), DiskPath: overlay}
	a := startAgentWith(t, res)
	store := t.TempDir()

	ctx := context.Background()
	cp := checkpointWithRootfs(t, a, api.CheckpointRequest{
		VM:    api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/run/vm/qmp.sock", DiskPath: "/run/vm/overlay.qcow2"},
		Image: "oci:" + store + ":vm", DiskImage: "oci:" + store + ":disk", RootfsImage: "oci:" + store + ":rootfs", Mode: "pause",
	})
	for what, img := range map[string]string{"vmstate": cp.VMState.Image, "disk": cp.Disk.Image, "rootfs": cp.Rootfs.Image} {
		if !strings.Contains(img, "@sha256:") {
			t.Errorf("%s image %q is not pinned by digest", what, img)
		}
	}
	if cp.Rootfs.ContainerID != c.ID || cp.Rootfs.Compression == "" || cp.Rootfs.LayerBytes == 0 {
		t.Errorf("rootfs result %+v", cp.Rootfs)
	}
	// The checkpoint index, which the tag names, lists the three images.
	ck := readCheckpoint(t, ctx, store, "vm")
	for _, want := range []struct{ part, image string }{
		{ociimage.PartVMState, cp.VMState.Image}, {ociimage.PartDisk, cp.Disk.Image}, {ociimage.PartRootfs, cp.Rootfs.Image},
	} {
		if p, ok := ck.Part(want.part); !ok || p.Linked || p.Ref.String() != want.image {
			t.Errorf("the checkpoint lists %+v as its %s, want %s", p, want.part, want.image)
		}
	}
	if ck.Ref.String() != cp.Checkpoint.Image {
		t.Errorf("the tag names %s, the result %s", ck.Ref, cp.Checkpoint.Image)
	}
}

// readCheckpoint reads the checkpoint tag names in the layout store.
func readCheckpoint(t *testing.T, ctx context.Context, store, tag string) *ociimage.Checkpoint {
	t.Helper()
	repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: store})
	if err != nil {
		t.Fatal(err)
	}
	c, err := ociimage.ReadCheckpoint(ctx, repo, mustResolve(t, store, tag))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestAgentRootfsNeedsContainerd: a resolver that cannot reach containers
// refuses a rootfs image at once, before anything is touched.
func TestAgentRootfsNeedsContainerd(t *testing.T) {
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<10))
	res := newStaticResolver()
	res.add(uid1, vm.Path())
	a := startAgent(t, t.TempDir(), res, 2)
	store := t.TempDir()
	_, err := a.client.Checkpoint(context.Background(), api.CheckpointRequest{
		VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/run/vm/qmp.sock"}, Image: "oci:" + store + ":vm", RootfsImage: "oci:" + store + ":rootfs",
	})
	if !errcode.Is(err, errcode.Usage) {
		t.Fatalf("rootfs image with a resolver that cannot capture: %v, want USAGE", err)
	}
	if vm.Status() != "running" {
		t.Fatal("the VM was touched")
	}
	_, err = a.client.Checkpoint(context.Background(), api.CheckpointRequest{
		VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/run/vm/qmp.sock"}, Image: "oci:" + store + ":vm", RootfsImage: "oci:" + store + ":rootfs", Mode: "live",
	})
	if !errcode.Is(err, errcode.Usage) {
		t.Fatalf("rootfs image in live mode: %v, want USAGE", err)
	}
}

// checkpointWithRootfs runs req through a and returns its result, failing
// t unless it succeeded with a disk and a rootfs part.
func checkpointWithRootfs(t *testing.T, a *testAgent, req api.CheckpointRequest) *api.CheckpointResult {
	t.Helper()
	op, err := a.client.Checkpoint(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	final := waitOp(t, a.client, op.ID)
	cp := final.Checkpoint
	if final.State != api.StateSucceeded || cp == nil || cp.Disk == nil || cp.Rootfs == nil {
		t.Fatalf("checkpoint ended %+v (error %+v)", final, final.Error)
	}
	return cp
}

// startAgentWith is startAgent for any Resolver.
func startAgentWith(t *testing.T, resolver Resolver) *testAgent {
	t.Helper()
	return startAgentConfig(t, Config{StateDir: t.TempDir(), Resolver: resolver})
}

// copyFile copies src to dst, creating dst's directory.
func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestAgentCheckpointDiskInWritableLayer: a disk overlay in the container's
// writable layer rides in the rootfs image: no disk image of its own
// (unless one is asked for as well), the result and the state manifest say
// where it is in the rootfs image, and the image's new layer holds it, byte
// for byte. A disk on a volume still needs a disk image.
func TestAgentCheckpointDiskInWritableLayer(t *testing.T) {
	d := testcontainerd.Start(t)
	c := d.Create(t, testcontainerd.PodContainer{PodUID: uid1})
	src := guest.NewDisk(t, t.TempDir())
	inLayer := filepath.Join(d.RootfsDir(c), "vm", "disk")
	copyFile(t, src, filepath.Join(inLayer, "overlay.qcow2"))
	copyFile(t, filepath.Join(filepath.Dir(src), "base.qcow2"), filepath.Join(inLayer, "base.qcow2"))
	overlay, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}

	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20))
	res := &ctrdResolver{newStaticResolver(), d.Client}
	res.vms[uid1] = api.Target{PodUID: uid1, Container: "qemu", ContainerID: c.ID, QMPPath: vm.Path(),
		DiskPath: filepath.Join(inLayer, "overlay.qcow2"), DiskInRootfs: true}
	a := startAgentWith(t, res)
	store := t.TempDir()
	ctx := context.Background()
	req := api.CheckpointRequest{
		VM:    api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/run/vm/qmp.sock", DiskPath: "/vm/disk/overlay.qcow2"},
		Image: "oci:" + store + ":vm", RootfsImage: "oci:" + store + ":rootfs", Mode: "snapshot",
	}
	cp := checkpointWithRootfs(t, a, req)
	want := api.DiskInRootfs{Image: cp.Rootfs.Image, Digest: cp.Rootfs.Digest, Path: "/vm/disk/overlay.qcow2"}
	if cp.Disk.Image != "" || cp.Disk.Digest != "" || cp.Disk.InRootfs == nil || *cp.Disk.InRootfs != want ||
		cp.Disk.RawBytes != int64(len(overlay)) || cp.Disk.VirtualSize != guest.DiskSizeMB<<20 || cp.Disk.BackingFile != "base.qcow2" {
		t.Fatalf("disk result %+v (in rootfs %+v), want it in the rootfs image at %s", cp.Disk, cp.Disk.InRootfs, want.Path)
	}
	ck := readCheckpoint(t, ctx, store, "vm")
	if p, ok := ck.Part(ociimage.PartRootfs); !ok || p.Ref.String() != cp.Rootfs.Image || ck.Annotations[ociimage.AnnotationDiskRootfsPath] != want.Path {
		t.Errorf("the checkpoint lists the rootfs %+v, annotations %v", p, ck.Annotations)
	}
	if _, ok := ck.Part(ociimage.PartDisk); ok {
		t.Errorf("the checkpoint lists a disk image: %+v", ck.Parts)
	}
	repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: store})
	if err != nil {
		t.Fatal(err)
	}
	rm, err := repo.Manifest(ctx, mustResolve(t, store, "rootfs"))
	if err != nil {
		t.Fatal(err)
	}
	entries := testcontainerd.TopLayer(t, store, rm)
	if e, ok := entries["vm/disk/overlay.qcow2"]; !ok || e.Digest != digest.FromBytes(overlay) {
		t.Fatalf("the rootfs image's layer does not hold the overlay as it was (%+v)", e)
	}

	// Asked for a disk image as well, it gets one too.
	req.DiskImage = "oci:" + store + ":disk"
	if cp := checkpointWithRootfs(t, a, req); cp.Disk.Image == "" || cp.Disk.InRootfs == nil || cp.Disk.InRootfs.Digest != cp.Rootfs.Digest {
		t.Fatalf("checkpoint with a disk image too: %+v", cp)
	}

	// A disk on a volume rides in no rootfs image: it needs a disk image.
	res.mu.Lock()
	tg := res.vms[uid1]
	tg.DiskInRootfs = false
	res.vms[uid1] = tg
	res.mu.Unlock()
	req.DiskImage = ""
	// The API's caller is told the request field it lacks (the CLI's flag
	// names are the CLI's to add).
	if _, err := a.client.Checkpoint(ctx, req); !errcode.Is(err, errcode.Usage) || !strings.Contains(err.Error(), "(`diskImage`)") {
		t.Fatalf("disk on a volume with a rootfs image only: %v, want USAGE", err)
	}
}

func mustResolve(t *testing.T, dir, tag string) ocispec.Descriptor {
	t.Helper()
	d, err := resolveIn(t, dir, ociimage.Reference{Tag: tag})
	if err != nil {
		t.Fatal(err)
	}
	return d
}
func resolveIn(t *testing.T, dir string, ref ociimage.Reference) (ocispec.Descriptor, error) {
	t.Helper()
	ref.Layout = dir
	repo, err := ociimage.Open(context.Background(), ref)
	if err != nil {
		t.Fatal(err)
	}
	return repo.Resolve(context.Background())
}
