package snapshot

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/ocischema"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
	"github.com/vmsnap/vmsnap/rootfs"
)

// captureContainerImage is a CaptureRootfs that stores a small container
// image (an OCI image config, one layer), as containerd's capture would.
func captureContainerImage(ctx context.Context, repo ociimage.Repository, _ func(int64)) (*rootfs.LayerResult, error) {
	layer := []byte("a tar+gzip layer, as far as this test is concerned")
	ld := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: digest.FromBytes(layer), Size: int64(len(layer))}
	cfg, _ := json.Marshal(ocispec.Image{Platform: ocispec.Platform{Architecture: "amd64", OS: "linux"},
		RootFS: ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{ld.Digest}}})
	cd := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: digest.FromBytes(cfg), Size: int64(len(cfg))}
	for _, b := range []struct {
		d    ocispec.Descriptor
		data []byte
	}{{ld, layer}, {cd, cfg}} {
		if err := repo.PutBlob(ctx, b.d, b.data); err != nil {
			return nil, err
		}
	}
	m, err := repo.PutManifest(ctx, ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest,
		Config: cd, Layers: []ocispec.Descriptor{ld}})
	if err != nil {
		return nil, err
	}
	return &rootfs.LayerResult{Image: repo.Reference().WithDigest(m.Digest), Manifest: m, Layer: ld}, nil
}

// readIndex reads a layout's checkpoint index.
func readIndex(t *testing.T, dir, d string) ocispec.Index {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "blobs", "sha256", strings.TrimPrefix(d, "sha256:")))
	if err != nil {
		t.Fatal(err)
	}
	var idx ocispec.Index
	if err := json.Unmarshal(b, &idx); err != nil {
		t.Fatal(err)
	}
	return idx
}

// TestCheckpointIndexListsItsImages: a checkpoint with its disk and rootfs
// images in its own repository stores one index that lists the three, in
// order, and the checkpoint's tag names it; no manifest names another
// (no subject, no link annotations). Restore, stage and inspect take the
// index's digest and pick their part; the next checkpoint's index links
// to this one for retention. Everything passes the image spec's schemas
// (two states, two disks, one rootfs image: the fake captures the same).
func TestCheckpointIndexListsItsImages(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	overlay := guest.NewDisk(t, t.TempDir())
	take := func(state []byte) *CheckpointSpec {
		return &CheckpointSpec{QMPPath: qmptest.NewFakeQEMU(t, "running", state).Path(), DiskPath: overlay,
			Image: "oci:" + dir + ":vm", DiskImage: "oci:" + dir + ":vm-disk", RootfsImage: "oci:" + dir + ":vm-rootfs",
			CaptureRootfs: captureContainerImage, Stream: chunk.StreamOptions{ChunkSize: 256 << 10}}
	}
	state := randomState(t, 1<<20)
	res, err := Checkpoint(ctx, *take(state))
	if err != nil {
		t.Fatal(err)
	}
	if res.Checkpoint == nil || res.Checkpoint.Image != "oci:"+dir+"@"+res.Checkpoint.Digest || resolveTag(t, dir, "vm") != res.Checkpoint.Digest {
		t.Fatalf("the checkpoint's tag names %s, the result says %+v", resolveTag(t, dir, "vm"), res.Checkpoint)
	}
	idx := readIndex(t, dir, res.Checkpoint.Digest)
	var parts, digests []string
	for _, e := range idx.Manifests {
		parts, digests = append(parts, e.Annotations[ociimage.AnnotationPart]), append(digests, e.Digest.String())
	}
	if !slices.Equal(parts, ociimage.Parts) || !slices.Equal(digests, []string{res.VMState.Digest, res.Disk.Digest, res.Rootfs.Digest}) {
		t.Fatalf("the index lists %v %v", parts, digests)
	}
	if idx.Annotations[ociimage.AnnotationCreated] == "" || idx.Annotations[ociimage.AnnotationPrevious] != "" {
		t.Fatalf("the first index's annotations: %v", idx.Annotations)
	}
	for _, d := range digests {
		if m := readManifest(t, dir, d); m.Subject != nil || m.Annotations[ociimage.AnnotationDiskImage] != "" || m.Annotations[ociimage.AnnotationRootfsImage] != "" {
			t.Fatalf("manifest %s links another image: subject %v, annotations %v", d, m.Subject, m.Annotations)
		}
	}

	index := res.Checkpoint.Image
	target := qmptest.NewFakeQEMU(t, "inmigrate", state)
	rs, err := RestoreState(ctx, RestoreSpec{QMPPath: target.Path(), Image: index})
	if err != nil || !bytes.Equal(received(target), state) || rs.VMState.Image != res.VMState.Image || rs.VMState.Checkpoint != index {
		t.Fatalf("restoring the state through the index: %+v, %v", rs, err)
	}
	disk := filepath.Join(filepath.Dir(overlay), "restored.qcow2")
	rd, err := RestoreDisk(ctx, DiskRestoreSpec{Image: index, Path: disk})
	if err != nil || rd.Image != res.Disk.Image || rd.Checkpoint != index || !sameFile(t, disk, overlay) {
		t.Fatalf("restoring the disk through the index: %+v, %v", rd, err)
	}
	st, err := Stage(ctx, StageSpec{Image: index, Dir: t.TempDir()})
	if err != nil || st.Digest != res.VMState.Digest || st.Checkpoint != index {
		t.Fatalf("staging through the index: %+v, %v", st, err)
	}
	ins, err := Inspect(ctx, InspectSpec{Image: "oci:" + dir + ":vm"})
	if err != nil {
		t.Fatal(err)
	}
	if c := ins.Checkpoint; c == nil || c.Image != index || c.VMState != res.VMState.Image || c.Disk != res.Disk.Image || c.Rootfs != res.Rootfs.Image ||
		ins.Image != res.VMState.Image || ins.LinkedDisk == nil || ins.LinkedRootfs == nil {
		t.Fatalf("inspect of the tag: %+v (checkpoint %+v)", ins, ins.Checkpoint)
	}

	appendToOverlay(t, overlay)
	next, err := Checkpoint(ctx, *take(randomState(t, 1<<20)))
	if err != nil {
		t.Fatal(err)
	}
	if got := readIndex(t, dir, next.Checkpoint.Digest).Annotations[ociimage.AnnotationPrevious]; got != res.Checkpoint.Digest {
		t.Fatalf("the next index links %q, want the first checkpoint %s", got, res.Checkpoint.Digest)
	}
	checked, err := ocischema.Layout(ctx, dir)
	if err != nil || checked[ocispec.MediaTypeImageIndex] != 2 || checked[ocispec.MediaTypeImageManifest] != 5 || checked[ocispec.MediaTypeImageConfig] != 1 {
		t.Fatalf("schemas: %v, %v", checked, err)
	}
}

func sameFile(t *testing.T, a, b string) bool {
	t.Helper()
	x, errx := os.ReadFile(a)
	y, erry := os.ReadFile(b)
	return errx == nil && erry == nil && bytes.Equal(x, y)
}

// TestCheckpointLinksADiskBesideIt: a disk image in another layout beside
// the checkpoint's is linked by that layout's name, not its path: moved
// together elsewhere, the two still restore through the checkpoint's index,
// and nothing is read where they were.
func TestCheckpointLinksADiskBesideIt(t *testing.T) {
	ctx := context.Background()
	root := filepath.Join(t.TempDir(), "snaps")
	overlay := guest.NewDisk(t, t.TempDir())
	state := randomState(t, 1<<20)
	res, err := Checkpoint(ctx, CheckpointSpec{QMPPath: qmptest.NewFakeQEMU(t, "running", state).Path(), DiskPath: overlay,
		Image: "oci:" + root + "/vm1:vm", DiskImage: "oci:" + root + "/vm1-disk:d", Stream: chunk.StreamOptions{ChunkSize: 256 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	idx := readIndex(t, root+"/vm1", res.Checkpoint.Digest)
	if len(idx.Manifests) != 1 || idx.Annotations[ociimage.AnnotationDiskLink] != "vm1-disk@"+res.Disk.Digest {
		t.Fatalf("the index lists %d images and links %q", len(idx.Manifests), idx.Annotations[ociimage.AnnotationDiskLink])
	}
	moved := filepath.Join(t.TempDir(), "elsewhere")
	if err := os.Rename(root, moved); err != nil {
		t.Fatal(err)
	}
	index := "oci:" + moved + "/vm1@" + res.Checkpoint.Digest
	disk := filepath.Join(filepath.Dir(overlay), "restored.qcow2")
	rd, err := RestoreDisk(ctx, DiskRestoreSpec{Image: index, Path: disk})
	if err != nil || rd.Image != "oci:"+moved+"/vm1-disk@"+res.Disk.Digest || !sameFile(t, disk, overlay) {
		t.Fatalf("restoring the moved disk through the index: %+v, %v", rd, err)
	}
	ins, err := Inspect(ctx, InspectSpec{Image: index})
	if err != nil || ins.Checkpoint == nil || ins.Checkpoint.Disk != rd.Image {
		t.Fatalf("inspect of the moved checkpoint: %+v, %v", ins, err)
	}
}

// TestCheckpointRefusesAnImageItCannotLink: a disk image that the index
// could neither list nor link so that a copy keeps the link (a layout that
// is not beside the checkpoint's), or that would share the checkpoint's tag
// in its repository, is refused before the VM is touched, and nothing is
// stored.
func TestCheckpointRefusesAnImageItCannotLink(t *testing.T) {
	ctx := context.Background()
	same := filepath.Join(t.TempDir(), "vm")
	for _, c := range []struct{ state, disk, want string }{
		{filepath.Join(t.TempDir(), "a", "state") + ":vm", filepath.Join(t.TempDir(), "b", "disk") + ":d", "so that a copy keeps the link"},
		{same + ":vm", same + ":vm", "would have the checkpoint's own tag"},
	} {
		vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20))
		_, err := Checkpoint(ctx, CheckpointSpec{QMPPath: vm.Path(), DiskPath: guest.NewDisk(t, t.TempDir()),
			Image: "oci:" + c.state, DiskImage: "oci:" + c.disk})
		if errcode.Of(err) != errcode.Usage || !strings.Contains(err.Error(), c.want) {
			t.Fatalf("disk image %s beside %s: %v, want USAGE saying %q", c.disk, c.state, err, c.want)
		}
		if slices.Contains(vm.Commands(), "stop") || vm.Status() != "running" {
			t.Fatalf("the VM was touched: %v", vm.Commands())
		}
		for _, ref := range []string{c.state, c.disk} {
			dir, _, _ := strings.Cut(ref, ":")
			if _, err := os.Stat(filepath.Join(dir, "index.json")); err == nil {
				t.Fatalf("%s was written", dir)
			}
		}
	}
}

// copyCheckpoint copies the checkpoint the index desc names from src to
// dst, as a copy tool does (every part, then the index, by digest), and
// tags it.
func copyCheckpoint(t *testing.T, src, dst ociimage.Repository, desc ocispec.Descriptor, tag string) {
	t.Helper()
	ctx := context.Background()
	idx, err := src.Index(ctx, desc)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range idx.Manifests {
		if _, err := ociimage.Copy(ctx, ociimage.Pinned(src, e), dst, 0, 4); err != nil {
			t.Fatal(err)
		}
	}
	got, err := dst.PutIndex(ctx, idx)
	if err != nil || got.Digest != desc.Digest {
		t.Fatalf("copied the index as %s (%v), want %s", got.Digest, err, desc.Digest)
	}
	if err := ociimage.TagManifest(ctx, dst, got, tag); err != nil {
		t.Fatal(err)
	}
}

// openRepo opens a reference with opts.
func openRepo(t *testing.T, ref string, opts []ociimage.Option) ociimage.Repository {
	t.Helper()
	r, err := ociimage.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	repo, err := ociimage.Open(context.Background(), r, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return repo
}

// TestCheckpointCopiedToAnotherRegistryRestoresFromTheCopyAlone: a
// checkpoint in one registry with its disk image in another repository of
// it, copied to a second registry (other credentials) under the same
// repository paths, restores from the copy with the first registry stopped:
// the index's digest names it there too, and its disk link leads to the
// second registry's repository.
func TestCheckpointCopiedToAnotherRegistryRestoresFromTheCopyAlone(t *testing.T) {
	ctx := context.Background()
	src, dst := registry.Start(t), registry.Start(t)
	overlay := guest.NewDisk(t, t.TempDir())
	state := randomState(t, 1<<20)
	res, err := Checkpoint(ctx, CheckpointSpec{QMPPath: qmptest.NewFakeQEMU(t, "running", state).Path(), DiskPath: overlay,
		Image: src.Host + "/vms/state:vm", DiskImage: src.Host + "/vms/disk:vm", Stream: chunk.StreamOptions{ChunkSize: 256 << 10}, Store: registryOpts(src)})
	if err != nil {
		t.Fatal(err)
	}
	srcState, dstState := openRepo(t, src.Host+"/vms/state", registryOpts(src)), openRepo(t, dst.Host+"/vms/state", registryOpts(dst))
	indexDesc, err := openRepo(t, res.Checkpoint.Image, registryOpts(src)).Resolve(ctx)
	if err != nil {
		t.Fatal(err)
	}
	idx, err := srcState.Index(ctx, indexDesc)
	if err != nil {
		t.Fatal(err)
	}
	if link := idx.Annotations[ociimage.AnnotationDiskLink]; link != "vms/disk@"+res.Disk.Digest {
		t.Fatalf("the disk link is %q, want the repository path without a host", link)
	}
	copyCheckpoint(t, srcState, dstState, indexDesc, "vm")
	diskDesc, err := openRepo(t, res.Disk.Image, registryOpts(src)).Resolve(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ociimage.Copy(ctx, ociimage.Pinned(openRepo(t, src.Host+"/vms/disk", registryOpts(src)), diskDesc), openRepo(t, dst.Host+"/vms/disk", registryOpts(dst)), 0, 4); err != nil {
		t.Fatal(err)
	}
	src.Stop()

	index := dst.Host + "/vms/state@" + res.Checkpoint.Digest
	target := qmptest.NewFakeQEMU(t, "inmigrate", state)
	if _, err := RestoreState(ctx, RestoreSpec{QMPPath: target.Path(), Image: index, Store: registryOpts(dst)}); err != nil || !bytes.Equal(received(target), state) {
		t.Fatalf("restoring the copy's state: %v", err)
	}
	disk := filepath.Join(filepath.Dir(overlay), "restored.qcow2")
	rd, err := RestoreDisk(ctx, DiskRestoreSpec{Image: index, Path: disk, Store: registryOpts(dst)})
	if err != nil || rd.Image != dst.Host+"/vms/disk@"+res.Disk.Digest || !sameFile(t, disk, overlay) {
		t.Fatalf("restoring the copy's disk: %+v, %v", rd, err)
	}
	ins, err := Inspect(ctx, InspectSpec{Image: dst.Host + "/vms/state:vm", Store: registryOpts(dst)})
	if err != nil || ins.Checkpoint.Image != index || ins.Checkpoint.Disk != rd.Image {
		t.Fatalf("inspect of the copy: %+v, %v", ins.Checkpoint, err)
	}
}

// TestParentByItsCheckpoint: a memory-file checkpoint's --parent may name
// the parent's checkpoint (its index) as well as its state image: either
// way the delta builds on the parent's state.
func TestParentByItsCheckpoint(t *testing.T) {
	ctx := context.Background()
	const memory = 16 << 20
	ram := filepath.Join(t.TempDir(), "ram")
	if err := os.WriteFile(ram, randomState(t, memory), 0o600); err != nil {
		t.Fatal(err)
	}
	qmptest.MapFile(t, ram)
	store := t.TempDir()
	take := func(tag, parent string) *api.CheckpointResult {
		t.Helper()
		q := qmptest.NewFakeQEMU(t, "running", randomState(t, 64<<10))
		q.Memory = memory
		q.RAMBackend = &qmptest.FakeBackend{ID: "ram0", Type: "memory-backend-file", MemPath: ram, Share: true}
		res, err := Checkpoint(ctx, CheckpointSpec{QMPPath: q.Path(), Image: "oci:" + store + ":" + tag, Parent: parent, StagingDir: t.TempDir()})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	base := take("base", "")
	for tag, parent := range map[string]string{"by-index": base.Checkpoint.Image, "by-state": base.VMState.Image} {
		d := take(tag, parent)
		if r := d.VMState.RAM; r == nil || r.Parent != base.VMState.Digest || len(r.Chain) != 2 {
			t.Fatalf("--parent %s: %+v, want a delta on the state %s", parent, d.VMState.RAM, base.VMState.Digest)
		}
	}
}
