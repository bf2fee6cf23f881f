package snapshot

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
	"github.com/vmsnap/vmsnap/rootfs"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

// resolveIn resolves ref (a tag or a digest) in the layout dir.
func resolveIn(t *testing.T, dir string, ref ociimage.Reference) (ocispec.Descriptor, error) {
	t.Helper()
	ref.Layout = dir
	repo, err := ociimage.Open(context.Background(), ref)
	if err != nil {
		t.Fatal(err)
	}
	return repo.Resolve(context.Background())
}

// resolveTag returns the digest a tag of a layout names, or "" if none.
func resolveTag(t *testing.T, dir, tag string) string {
	t.Helper()
	d, err := resolveIn(t, dir, ociimage.Reference{Tag: tag})
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
	overlay := guest.NewDisk(t, t.TempDir())
	stateDir, diskDir := t.TempDir(), t.TempDir()
	spec := func(vm *qmptest.FakeQEMU, mode vmspec.Mode) CheckpointSpec {
		return CheckpointSpec{
			QMPPath: vm.Path(), DiskPath: overlay, Image: "oci:" + stateDir + ":vm", DiskImage: "oci:" + diskDir + ":vm-disk",
			Mode: mode, Stream: chunk.StreamOptions{ChunkSize: 256 << 10},
		}
	}
	first, err := Checkpoint(ctx, spec(qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20)), vmspec.ModeSnapshot))
	if err != nil {
		t.Fatal(err)
	}
	if resolveTag(t, stateDir, "vm") != first.Checkpoint.Digest || resolveTag(t, diskDir, "vm-disk") != first.Disk.Digest {
		t.Fatalf("after a checkpoint the tags do not name its images")
	}

	// The disk changes, and the state's store now refuses manifests: its
	// index cannot be locked for the update.
	appendToOverlay(t, overlay)
	lock := filepath.Join(stateDir, "index.json.lock")
	if err := os.Remove(lock); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(lock, 0o755); err != nil {
		t.Fatal(err)
	}
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20))
	_, err = Checkpoint(ctx, spec(vm, vmspec.ModePause))
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
	if got := resolveTag(t, stateDir, "vm"); got != first.Checkpoint.Digest {
		t.Fatalf("the checkpoint tag moved to %s although the checkpoint failed", got)
	}

	// Once the store works again, a checkpoint moves both tags.
	if err := os.Remove(lock); err != nil {
		t.Fatal(err)
	}
	third, err := Checkpoint(ctx, spec(vm, vmspec.ModePause))
	if err != nil {
		t.Fatal(err)
	}
	if third.Disk.Digest == first.Disk.Digest || third.VMState.Digest == first.VMState.Digest {
		t.Fatal("the third checkpoint stored the same images as the first")
	}
	if resolveTag(t, stateDir, "vm") != third.Checkpoint.Digest || resolveTag(t, diskDir, "vm-disk") != third.Disk.Digest {
		t.Fatalf("the tags did not move to the third checkpoint's images")
	}
}

// TestCheckpointSpecDisk: a disk overlay needs an image of its own unless
// it rides in the rootfs image; the store cannot be a digest.
func TestCheckpointSpecDisk(t *testing.T) {
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<10))
	store := "oci:" + t.TempDir()
	for name, c := range map[string]struct {
		spec CheckpointSpec
		want errcode.Code
	}{
		"disk without image":                  {CheckpointSpec{DiskPath: "/d"}, errcode.Usage},
		"disk image without disk":             {CheckpointSpec{DiskImage: store + ":d"}, errcode.Usage},
		"disk on a volume, rootfs image only": {CheckpointSpec{DiskPath: "/d", RootfsImage: store + ":r"}, errcode.Usage},
		"digest reference":                    {CheckpointSpec{Image: store + "@sha256:" + strings.Repeat("a", 64)}, errcode.InvalidInput},
	} {
		s := c.spec
		s.QMPPath = vm.Path()
		if s.Image == "" {
			s.Image = store + ":vm"
		}
		s.CaptureRootfs = func(context.Context, ociimage.Repository, func(int64)) (*rootfs.LayerResult, error) {
			t.Errorf("%s: the rootfs was captured", name)
			return nil, errcode.New(errcode.Internal, "no")
		}
		_, err := Checkpoint(context.Background(), s)
		if got := errcode.Of(err); got != c.want {
			t.Errorf("%s: %v (%s), want %s", name, err, got, c.want)
		}
	}
	if vm.Status() != "running" || slices.Contains(vm.Commands(), "stop") {
		t.Fatalf("the VM was touched: %v", vm.Commands())
	}
}

// appendToOverlay changes the disk overlay, so that the next checkpoint
// stores a different disk image.
func appendToOverlay(t *testing.T, overlay string) {
	t.Helper()
	f, err := os.OpenFile(overlay, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(make([]byte, 64<<10)); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

// breakIndexLock makes a layout refuse every index update from now on.
func breakIndexLock(t *testing.T, dir string) {
	t.Helper()
	lock := filepath.Join(dir, "index.json.lock")
	if err := os.Remove(lock); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	if err := os.Mkdir(lock, 0o755); err != nil {
		t.Fatal(err)
	}
}

// TestCheckpointMovesTheDiskTagBackWhenTheRootfsTagFails: the disk tag
// moves first; when the rootfs tag then cannot move, the disk tag is moved
// back, and every tag names the previous checkpoint's images.
func TestCheckpointMovesTheDiskTagBackWhenTheRootfsTagFails(t *testing.T) {
	ctx := context.Background()
	overlay := guest.NewDisk(t, t.TempDir())
	stateDir, diskDir, rootfsDir := t.TempDir(), t.TempDir(), t.TempDir()
	captures := 0
	spec := func(vm *qmptest.FakeQEMU, breakRootfs bool) CheckpointSpec {
		return CheckpointSpec{
			QMPPath: vm.Path(), DiskPath: overlay, Image: "oci:" + stateDir + ":vm", DiskImage: "oci:" + diskDir + ":vm-disk",
			RootfsImage: "oci:" + rootfsDir + ":vm-rootfs", Stream: chunk.StreamOptions{ChunkSize: 256 << 10},
			CaptureRootfs: func(ctx context.Context, repo ociimage.Repository, _ func(int64)) (*rootfs.LayerResult, error) {
				captures++
				desc, err := ociimage.PushArtifact(ctx, repo, ociimage.Artifact{
					ArtifactType: ociimage.ArtifactTypeDisk, ConfigMediaType: ociimage.MediaTypeDiskConfig,
					Config: map[string]int{"capture": captures},
				})
				if err != nil {
					return nil, err
				}
				if breakRootfs {
					breakIndexLock(t, rootfsDir)
				}
				return &rootfs.LayerResult{Image: repo.Reference().WithDigest(desc.Digest), Manifest: desc}, nil
			},
		}
	}
	first, err := Checkpoint(ctx, spec(qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20)), false))
	if err != nil {
		t.Fatal(err)
	}
	if resolveTag(t, stateDir, "vm") != first.Checkpoint.Digest || resolveTag(t, diskDir, "vm-disk") != first.Disk.Digest ||
		resolveTag(t, rootfsDir, "vm-rootfs") != first.Rootfs.Digest {
		t.Fatal("after a checkpoint the tags do not name its images")
	}

	appendToOverlay(t, overlay)
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20))
	_, err = Checkpoint(ctx, spec(vm, true))
	if errcode.Of(err) != errcode.RegistryError || !strings.Contains(err.Error(), "index.json.lock") {
		t.Fatalf("checkpoint whose rootfs tag cannot move: %v, want REGISTRY_ERROR", err)
	}
	if d := strings.Join(errcode.DetailsOf(err), "\n"); !strings.Contains(d, "disk tag oci:"+diskDir+":vm-disk was moved back to "+first.Disk.Digest) {
		t.Fatalf("the error does not say that the disk tag was moved back: %v", err)
	}
	if vm.Status() != "running" {
		t.Fatalf("the VM is %s after the failed checkpoint", vm.Status())
	}
	if got := resolveTag(t, diskDir, "vm-disk"); got != first.Disk.Digest {
		t.Fatalf("the disk tag names %s after the failed checkpoint, not the first disk %s", got, first.Disk.Digest)
	}
	if got := resolveTag(t, rootfsDir, "vm-rootfs"); got != first.Rootfs.Digest {
		t.Fatalf("the rootfs tag names %s after the failed checkpoint, not the first rootfs %s", got, first.Rootfs.Digest)
	}
	if got := resolveTag(t, stateDir, "vm"); got != first.Checkpoint.Digest {
		t.Fatalf("the checkpoint tag names %s after the failed checkpoint, not the first checkpoint %s", got, first.Checkpoint.Digest)
	}
}

// refuseTagging is a repository whose tags move only ok more times.
type refuseTagging struct {
	ociimage.Repository
	ok     int
	panics bool // instead of refusing, as a store with a bug would
}

func (r *refuseTagging) TagManifest(ctx context.Context, desc ocispec.Descriptor, tag string) error {
	if r.ok <= 0 && r.panics {
		panic("a bug in tagging")
	}
	if r.ok <= 0 {
		return errcode.New(errcode.RegistryError, "tagging refused")
	}
	r.ok--
	return ociimage.TagManifest(ctx, r.Repository, desc, tag)
}

// pinned resolves a digest in a layout.
func pinned(t *testing.T, dir, d string) ocispec.Descriptor {
	t.Helper()
	desc, err := resolveIn(t, dir, ociimage.Reference{Digest: digest.Digest(d)})
	if err != nil {
		t.Fatal(err)
	}
	return desc
}

// TestMoveTagsMovesBackWhenTheStateTagFails: when the VM state's tag, the
// commit point, cannot move after the disk tag moved, the disk tag is moved
// back where it was; one that named nothing before, or that cannot be moved
// back, stays on the new disk, and the error says so.
func TestMoveTagsMovesBackWhenTheStateTagFails(t *testing.T) {
	ctx := context.Background()
	overlay := guest.NewDisk(t, t.TempDir())
	stateDir, diskDir := t.TempDir(), t.TempDir()
	checkpoint := func(tagged bool) *api.CheckpointResult {
		t.Helper()
		image, diskImage := "oci:"+stateDir, "oci:"+diskDir
		if tagged {
			image, diskImage = image+":vm", diskImage+":vm-disk"
		}
		res, err := Checkpoint(ctx, CheckpointSpec{
			QMPPath: qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20)).Path(), DiskPath: overlay,
			Image: image, DiskImage: diskImage, Stream: chunk.StreamOptions{ChunkSize: 256 << 10},
		})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	first := checkpoint(true)
	appendToOverlay(t, overlay)
	second := checkpoint(false) // stored by digest only: no tag moves
	if resolveTag(t, stateDir, "vm") != first.Checkpoint.Digest || resolveTag(t, diskDir, "vm-disk") != first.Disk.Digest {
		t.Fatal("a checkpoint without tags moved the tags")
	}
	disk2, state2 := pinned(t, diskDir, second.Disk.Digest), pinned(t, stateDir, second.Checkpoint.Digest)

	for _, c := range []struct {
		name, diskTag string
		diskOK        int    // tag moves the disk store allows
		wantDisk      string // what the disk tag names afterwards
		wantDetail    string
		statePanics   bool // the state's store panics instead of refusing
	}{
		{"moved back", "vm-disk", 2, first.Disk.Digest, "was moved back to " + first.Disk.Digest, false},
		{"new tag", "new-disk", 2, second.Disk.Digest, "is left on the new manifest " + second.Disk.Digest + ": it named no manifest before", false},
		{"moving back fails", "vm-disk", 1, second.Disk.Digest, "is left on the new manifest " + second.Disk.Digest + ": moving it back to " + first.Disk.Digest + " failed", false},
		{"the state's tagging panics", "vm-disk", 2, first.Disk.Digest, "was moved back to " + first.Disk.Digest, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			disk, err := openStore(ctx, "oci:"+diskDir+":"+c.diskTag, nil)
			if err != nil {
				t.Fatal(err)
			}
			state, err := openStore(ctx, "oci:"+stateDir+":vm", nil)
			if err != nil {
				t.Fatal(err)
			}
			disk.repo = &refuseTagging{Repository: disk.repo, ok: c.diskOK}
			state.repo = &refuseTagging{Repository: state.repo, panics: c.statePanics}
			err = moveTags(ctx, tagMove{what: "disk", st: disk, to: disk2}, tagMove{what: "checkpoint", st: state, to: state2})
			wantCode, wantMsg := errcode.RegistryError, "tagging refused"
			if c.statePanics {
				wantCode, wantMsg = errcode.Internal, "a bug in tagging"
			}
			if errcode.Of(err) != wantCode || !strings.Contains(err.Error(), wantMsg) {
				t.Fatalf("moving the tags: %v, want %s", err, wantCode)
			}
			if d := strings.Join(errcode.DetailsOf(err), "\n"); !strings.Contains(d, "disk tag oci:"+diskDir+":"+c.diskTag+" "+c.wantDetail) {
				t.Fatalf("the error does not say %q: %v", c.wantDetail, err)
			}
			if got := resolveTag(t, diskDir, c.diskTag); got != c.wantDisk {
				t.Fatalf("the disk tag names %s, want %s", got, c.wantDisk)
			}
			if got := resolveTag(t, stateDir, "vm"); got != first.Checkpoint.Digest {
				t.Fatalf("the checkpoint tag names %s, not the first checkpoint %s", got, first.Checkpoint.Digest)
			}
			if c.wantDisk != first.Disk.Digest {
				// Put the tag back for the next case.
				if err := ociimage.TagManifest(ctx, disk.repo.(*refuseTagging).Repository, pinned(t, diskDir, first.Disk.Digest), "vm-disk"); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}
