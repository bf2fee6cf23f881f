package agent

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testguest"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
	"github.com/vmsnap/vmsnap/rootfs"
	"github.com/vmsnap/vmsnap/vmstate"
)

// checkpointToLayout stores a fake VM's state in a layout and returns the
// pinned reference.
func checkpointToLayout(t *testing.T, state []byte) (string, string) {
	t.Helper()
	vm := qmptest.NewFakeQEMU(t, "running", state)
	store := t.TempDir()
	res, err := Checkpoint(context.Background(), CheckpointSpec{
		QMPPath: vm.Path(), Image: "oci:" + store + ":vm", Stream: vmstate.StreamOptions{ChunkSize: 256 << 10},
	})
	if err != nil {
		t.Fatal(err)
	}
	return res.VMState.Image, store
}

func TestStageThenStreamGivesTheExactState(t *testing.T) {
	state := randomState(t, 2<<20)
	image, _ := checkpointToLayout(t, state)
	dir := filepath.Join(t.TempDir(), "staged")
	st, err := Stage(context.Background(), StageSpec{Image: image, Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if st.Bytes <= 0 || st.Dir != dir {
		t.Fatalf("staged %+v", st)
	}
	var out bytes.Buffer
	if err := StreamStaged(context.Background(), dir, &out, vmstate.StreamOptions{}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(out.Bytes(), state) {
		t.Fatalf("streamed %d bytes, not the %d captured", out.Len(), len(state))
	}
}

func TestStageRefusesOversizedAndTaggedImages(t *testing.T) {
	image, store := checkpointToLayout(t, randomState(t, 2<<20))
	dir := filepath.Join(t.TempDir(), "staged")
	_, err := Stage(context.Background(), StageSpec{Image: image, Dir: dir, MaxBytes: 64 << 10})
	if errcode.Of(err) != errcode.InvalidInput {
		t.Fatalf("over the limit: %v, want INVALID_INPUT", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "blobs")); err == nil {
		t.Fatal("an oversized image was partly staged")
	}
	if _, err := Stage(context.Background(), StageSpec{Image: "oci:" + store + ":vm", Dir: dir}); errcode.Of(err) != errcode.TagNotAllowed {
		t.Fatalf("by tag: %v, want TAG_NOT_ALLOWED", err)
	}
}

func TestStreamStagedRefusesTamperedChunk(t *testing.T) {
	state := randomState(t, 2<<20)
	image, _ := checkpointToLayout(t, state)
	dir := filepath.Join(t.TempDir(), "staged")
	if _, err := Stage(context.Background(), StageSpec{Image: image, Dir: dir}); err != nil {
		t.Fatal(err)
	}
	repo, err := ociimage.Open(context.Background(), ociimage.Reference{Layout: dir, Tag: StagedTag})
	if err != nil {
		t.Fatal(err)
	}
	_, m, _, err := vmstate.LoadConfig(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	blob := filepath.Join(dir, "blobs", "sha256", m.Layers[3].Digest.Encoded())
	b, _ := os.ReadFile(blob)
	b[len(b)/2] ^= 1
	if err := os.WriteFile(blob, b, 0o644); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	err = StreamStaged(context.Background(), dir, &out, vmstate.StreamOptions{})
	if errcode.Of(err) != errcode.DigestMismatch {
		t.Fatalf("err = %v, want DIGEST_MISMATCH", err)
	}
	var before int64 // the raw bytes of the 3 chunks before the bad one
	for _, l := range m.Layers[:3] {
		n, err := strconv.ParseInt(l.Annotations[ociimage.AnnotationRawSize], 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		before += n
	}
	if int64(out.Len()) != before {
		t.Fatalf("wrote %d bytes: only the %d of the 3 verified chunks before the bad one may reach QEMU", out.Len(), before)
	}
}

// resolveTag returns the digest a tag of a layout names, or "" if none.
func resolveTag(t *testing.T, dir, tag string) string {
	t.Helper()
	repo, err := ociimage.Open(context.Background(), ociimage.Reference{Layout: dir, Tag: tag})
	if err != nil {
		t.Fatal(err)
	}
	d, err := repo.Resolve(context.Background())
	if err != nil {
		return ""
	}
	return d.Digest.String()
}

// TestCheckpointTagsMoveOnlyOnceEverythingIsStored: every manifest of a
// checkpoint is stored by digest first. A store that refuses the VM state's
// manifest fails the checkpoint after the disk image was stored, and no tag
// has moved: the disk's tag still names the previous checkpoint's disk.
func TestCheckpointTagsMoveOnlyOnceEverythingIsStored(t *testing.T) {
	ctx := context.Background()
	overlay := testguest.NewDisk(t, t.TempDir())
	stateDir, diskDir := t.TempDir(), t.TempDir()
	spec := func(vm *qmptest.FakeQEMU, mode vmstate.Mode) CheckpointSpec {
		return CheckpointSpec{
			QMPPath: vm.Path(), DiskPath: overlay, Image: "oci:" + stateDir + ":vm", DiskImage: "oci:" + diskDir + ":vm-disk",
			Mode: mode, Stream: vmstate.StreamOptions{ChunkSize: 256 << 10},
		}
	}
	first, err := Checkpoint(ctx, spec(qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20)), vmstate.ModeSnapshot))
	if err != nil {
		t.Fatal(err)
	}
	if resolveTag(t, stateDir, "vm") != first.VMState.Digest || resolveTag(t, diskDir, "vm-disk") != first.Disk.Digest {
		t.Fatalf("after a checkpoint the tags do not name its images")
	}

	// The disk changes, and the state's store now refuses manifests: its
	// index cannot be locked for the update.
	f, err := os.OpenFile(overlay, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Write(make([]byte, 64<<10))
	f.Close()
	lock := filepath.Join(stateDir, "index.json.lock")
	if err := os.Remove(lock); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(lock, 0o755); err != nil {
		t.Fatal(err)
	}
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20))
	_, err = Checkpoint(ctx, spec(vm, vmstate.ModePause))
	if errcode.Of(err) != errcode.RegistryError || !strings.Contains(err.Error(), "index.json.lock") {
		t.Fatalf("checkpoint into a store refusing the state manifest: %v, want REGISTRY_ERROR", err)
	}
	if vm.Status() != "running" {
		t.Fatalf("the VM is %s after the failed checkpoint", vm.Status())
	}
	repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: diskDir})
	if err != nil {
		t.Fatal(err)
	}
	tags, err := repo.(*ociimage.Layout).Tags(ctx)
	if err != nil {
		t.Fatal(err)
	}
	idx, err := os.ReadFile(filepath.Join(diskDir, "index.json"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(idx), `"digest"`); n != 2 || len(tags) != 1 {
		t.Fatalf("the disk store should hold both disk images, one tagged: %s", idx)
	}
	if got := resolveTag(t, diskDir, "vm-disk"); got != first.Disk.Digest {
		t.Fatalf("the disk tag moved to %s although the checkpoint failed (was %s)", got, first.Disk.Digest)
	}
	if got := resolveTag(t, stateDir, "vm"); got != first.VMState.Digest {
		t.Fatalf("the state tag moved to %s although the checkpoint failed", got)
	}

	// Once the store works again, a checkpoint moves both tags.
	if err := os.Remove(lock); err != nil {
		t.Fatal(err)
	}
	third, err := Checkpoint(ctx, spec(vm, vmstate.ModePause))
	if err != nil {
		t.Fatal(err)
	}
	if third.Disk.Digest == first.Disk.Digest || third.VMState.Digest == first.VMState.Digest {
		t.Fatal("the third checkpoint stored the same images as the first")
	}
	if resolveTag(t, stateDir, "vm") != third.VMState.Digest || resolveTag(t, diskDir, "vm-disk") != third.Disk.Digest {
		t.Fatalf("the tags did not move to the third checkpoint's images")
	}
}

// TestCheckpointSpecDisk: a disk overlay needs an image of its own unless
// it rides in the rootfs image; the store cannot be a digest.
func TestCheckpointSpecDisk(t *testing.T) {
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<10))
	store := "oci:" + t.TempDir()
	for name, s := range map[string]CheckpointSpec{
		"disk without image":                  {DiskPath: "/d"},
		"disk image without disk":             {DiskImage: store + ":d"},
		"disk on a volume, rootfs image only": {DiskPath: "/d", RootfsImage: store + ":r"},
		"digest reference":                    {Image: store + "@sha256:" + strings.Repeat("a", 64)},
	} {
		s.QMPPath = vm.Path()
		if s.Image == "" {
			s.Image = store + ":vm"
		}
		s.CaptureRootfs = func(context.Context, ociimage.Repository, func(int64)) (*rootfs.LayerResult, error) {
			t.Errorf("%s: the rootfs was captured", name)
			return nil, errcode.New(errcode.Internal, "no")
		}
		_, err := Checkpoint(context.Background(), s)
		if c := errcode.Of(err); c != errcode.Usage && c != errcode.InvalidInput {
			t.Errorf("%s: %v, want USAGE or INVALID_INPUT", name, err)
		}
	}
	if vm.Status() != "running" || slices.Contains(vm.Commands(), "stop") {
		t.Fatalf("the VM was touched: %v", vm.Commands())
	}
}
