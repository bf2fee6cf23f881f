package snapshot

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/prunetest"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// taken is one checkpoint of a fake VM: its result, the state it streamed
// and a copy of the overlay as it was captured.
type taken struct {
	res     *api.CheckpointResult
	state   []byte
	overlay []byte
}

// fourCheckpoints takes four checkpoints of one fake VM under the tags vm
// and vm-disk of the store at image (oci:DIR or a registry repository).
// The disk changes before the second and the fourth, so the second and
// third disk images share their chunks (each image has a config of its
// own: it records when it was taken).
func fourCheckpoints(t *testing.T, image string, opts []ociimage.Option) (overlay string, cps []taken) {
	t.Helper()
	overlay = guest.NewDisk(t, t.TempDir())
	for i := range 4 {
		if i == 1 || i == 3 {
			appendToOverlay(t, overlay)
		}
		state := randomState(t, 1<<20)
		res, err := Checkpoint(context.Background(), CheckpointSpec{
			QMPPath: qmptest.NewFakeQEMU(t, "running", state).Path(), DiskPath: overlay,
			Image: image + ":vm", DiskImage: image + ":vm-disk", Stream: chunk.StreamOptions{ChunkSize: 256 << 10}, Store: opts,
		})
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(overlay)
		if err != nil {
			t.Fatal(err)
		}
		cps = append(cps, taken{res, state, b})
	}
	return overlay, cps
}

// restoresExactly restores a checkpoint's state into a fake QEMU (which
// completes only on the exact bytes) and its disk image beside the
// overlay (where its backing file is), and compares the disk.
func restoresExactly(t *testing.T, overlay string, cp taken, opts []ociimage.Option) {
	t.Helper()
	ctx := context.Background()
	target := qmptest.NewFakeQEMU(t, "inmigrate", cp.state)
	if _, err := RestoreState(ctx, RestoreSpec{QMPPath: target.Path(), Image: cp.res.VMState.Image, Store: opts}); err != nil {
		t.Fatalf("restoring kept checkpoint %s: %v", cp.res.VMState.Digest, err)
	}
	if !bytes.Equal(received(target), cp.state) {
		t.Fatalf("the restored state of %s differs from what was captured", cp.res.VMState.Digest)
	}
	dst := filepath.Join(filepath.Dir(overlay), "restored.qcow2")
	if _, err := RestoreDisk(ctx, DiskRestoreSpec{Image: cp.res.Disk.Image, Path: dst, Store: opts}); err != nil {
		t.Fatalf("restoring the disk of kept checkpoint %s: %v", cp.res.VMState.Digest, err)
	}
	got, err := os.ReadFile(dst)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, cp.overlay) {
		t.Fatalf("the restored disk of %s differs from the captured overlay", cp.res.VMState.Digest)
	}
	os.Remove(dst)
}

// blobsOf lists the blobs a stored manifest names, and the manifest.
func blobsOf(t *testing.T, dir, d string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "blobs", "sha256", strings.TrimPrefix(d, "sha256:")))
	if err != nil {
		t.Fatal(err)
	}
	var m ocispec.Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	out := []string{d, m.Config.Digest.String()}
	for _, l := range m.Layers {
		out = append(out, l.Digest.String())
	}
	return out
}

// checkpointBlobs lists the blobs of a checkpoint: its index, and the
// manifests, configs and layers of its state and disk images.
func checkpointBlobs(t *testing.T, dir string, cp taken) []string {
	t.Helper()
	return append(append([]string{cp.res.Checkpoint.Digest}, blobsOf(t, dir, cp.res.VMState.Digest)...), blobsOf(t, dir, cp.res.Disk.Digest)...)
}

// checkpointDigests are the digests of the checkpoints (their indexes).
func checkpointDigests(cps ...taken) []string {
	var out []string
	for _, cp := range cps {
		out = append(out, cp.res.Checkpoint.Digest)
	}
	return out
}

func blobExists(dir, d string) bool {
	_, err := os.Stat(filepath.Join(dir, "blobs", "sha256", strings.TrimPrefix(d, "sha256:")))
	return err == nil
}

// TestPruneLayoutKeepsTheNewestFindsTheUntaggedAndRemovesTheRest: four
// checkpoints under one tag, three of them found only through the
// previous links; --keep 2 keeps the two newest, which restore exactly
// (state and disk), and removes the others' manifests, their disk images and
// every blob only they needed; the disk chunks the third shares with the
// second stay.
func TestPruneLayoutKeepsTheNewestFindsTheUntaggedAndRemovesTheRest(t *testing.T) {
	dir := t.TempDir()
	overlay, cps := fourCheckpoints(t, "oci:"+dir, nil)
	for i, cp := range cps {
		m := readManifest(t, dir, cp.res.Checkpoint.Digest)
		want := ""
		if i > 0 {
			want = cps[i-1].res.Checkpoint.Digest
		}
		if got := m.Annotations[ociimage.AnnotationPrevious]; got != want {
			t.Fatalf("checkpoint %d links to %q, want %q", i, got, want)
		}
		if m.Annotations[ociimage.AnnotationCreated] == "" {
			t.Fatalf("checkpoint %d has no creation time", i)
		}
	}

	// A dry run finds them all and changes nothing.
	index, _ := os.ReadFile(filepath.Join(dir, "index.json"))
	blobs, _ := os.ReadDir(filepath.Join(dir, "blobs", "sha256"))
	dry, err := Prune(context.Background(), PruneSpec{Repo: "oci:" + dir, Keep: 2, DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	wantKept := checkpointDigests(cps[3], cps[2])
	wantRemoved := checkpointDigests(cps[1], cps[0])
	if !slices.Equal(prunetest.Digests(dry.Kept), wantKept) || !slices.Equal(prunetest.Digests(dry.Removed), wantRemoved) || !dry.DryRun {
		t.Fatalf("dry run kept %v removed %v, want %v and %v", prunetest.Digests(dry.Kept), prunetest.Digests(dry.Removed), wantKept, wantRemoved)
	}
	index2, _ := os.ReadFile(filepath.Join(dir, "index.json"))
	blobs2, _ := os.ReadDir(filepath.Join(dir, "blobs", "sha256"))
	if !bytes.Equal(index, index2) || len(blobs) != len(blobs2) {
		t.Fatal("the dry run changed the layout")
	}

	// Blobs only the removed checkpoints and their own disk image hold.
	needed := map[string]bool{}
	for _, cp := range cps[2:] {
		for _, b := range checkpointBlobs(t, dir, cp) {
			needed[b] = true
		}
	}
	// Each once: the two removed checkpoints may share a blob (their disk
	// images' configs, a chunk), which goes once.
	var doomed []string
	for _, cp := range cps[:2] {
		for _, b := range checkpointBlobs(t, dir, cp) {
			if !needed[b] && !slices.Contains(doomed, b) {
				doomed = append(doomed, b)
			}
		}
	}

	shared := 0
	for _, b := range blobsOf(t, dir, cps[1].res.Disk.Digest) {
		if needed[b] {
			shared++
		}
	}
	if shared == 0 {
		t.Fatal("the second and third disk images share no chunk; the test needs one")
	}

	res, err := Prune(context.Background(), PruneSpec{Repo: "oci:" + dir, Keep: 2})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(prunetest.Digests(res.Kept), wantKept) || !slices.Equal(prunetest.Digests(res.Removed), wantRemoved) {
		t.Fatalf("kept %v removed %v", prunetest.Digests(res.Kept), prunetest.Digests(res.Removed))
	}
	var removedImages []string
	for _, im := range res.RemovedImages {
		removedImages = append(removedImages, im.Image)
	}
	wantImages := []string{cps[1].res.VMState.Image, cps[1].res.Disk.Image, cps[0].res.VMState.Image, cps[0].res.Disk.Image}
	if !slices.Equal(removedImages, wantImages) || len(res.LeftImages) != 0 {
		t.Fatalf("removed images %v, left %+v; want the first two state and disk images %v", removedImages, res.LeftImages, wantImages)
	}
	if res.RemovedBlobs != len(doomed) {
		t.Fatalf("removed %d blobs, want %d", res.RemovedBlobs, len(doomed))
	}
	for _, b := range doomed {
		if blobExists(dir, b) {
			t.Fatalf("blob %s of a removed checkpoint is still there", b)
		}
	}
	for b := range needed {
		if !blobExists(dir, b) {
			t.Fatalf("blob %s of a kept checkpoint was removed", b)
		}
	}
	for _, cp := range cps[:2] {
		for _, d := range []string{cp.res.Checkpoint.Digest, cp.res.VMState.Digest, cp.res.Disk.Digest} {
			if !prunetest.ManifestGone(t, "oci:"+dir, d, nil) {
				t.Fatalf("%s of removed checkpoint %s still resolves", d, cp.res.Checkpoint.Digest)
			}
		}
	}
	if resolveTag(t, dir, "vm") != cps[3].res.Checkpoint.Digest || resolveTag(t, dir, "vm-disk") != cps[3].res.Disk.Digest {
		t.Fatal("the tags moved")
	}
	for _, cp := range cps[2:] {
		restoresExactly(t, overlay, cp, nil)
	}

	// Nothing left to do: a second prune removes nothing.
	again, err := Prune(context.Background(), PruneSpec{Repo: "oci:" + dir, Keep: 2})
	if err != nil || len(again.Removed) != 0 || again.RemovedBlobs != 0 || len(again.Kept) != 2 {
		t.Fatalf("second prune: %+v, %v", again, err)
	}
}

func readManifest(t *testing.T, dir, d string) ocispec.Manifest {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "blobs", "sha256", strings.TrimPrefix(d, "sha256:")))
	if err != nil {
		t.Fatal(err)
	}
	var m ocispec.Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// TestPruneInterruptedAtEveryStepLeavesTheKeptRestorable stops a prune
// before each of its deletions in turn (as a crash there would), checks
// that both kept checkpoints still restore exactly, and that running the
// prune again finishes the job.
func TestPruneInterruptedAtEveryStepLeavesTheKeptRestorable(t *testing.T) {
	interrupted := errors.New("interrupted")
	for stop := 1; ; stop++ {
		dir := t.TempDir()
		overlay, cps := fourCheckpoints(t, "oci:"+dir, nil)
		n := 0
		var steps []string
		pruneStep = func(what string) error {
			n++
			steps = append(steps, what)
			if n == stop {
				return interrupted
			}
			return nil
		}
		_, err := Prune(context.Background(), PruneSpec{Repo: "oci:" + dir, Keep: 2})
		pruneStep = nil
		if err == nil {
			if stop < 4 {
				t.Fatalf("the prune had only %d steps: %v", stop-1, steps)
			}
			break
		}
		if !errors.Is(err, interrupted) {
			t.Fatalf("step %d: %v", stop, err)
		}
		for _, cp := range cps[2:] {
			restoresExactly(t, overlay, cp, nil)
		}
		res, err := Prune(context.Background(), PruneSpec{Repo: "oci:" + dir, Keep: 2})
		if err != nil {
			t.Fatalf("prune after an interruption at step %d (%s): %v", stop, steps[stop-1], err)
		}
		if !slices.Equal(prunetest.Digests(res.Kept), checkpointDigests(cps[3], cps[2])) {
			t.Fatalf("after an interruption at %s, kept %v", steps[stop-1], prunetest.Digests(res.Kept))
		}
		for _, cp := range cps[:2] {
			for _, d := range []string{cp.res.Checkpoint.Digest, cp.res.VMState.Digest} {
				if !prunetest.ManifestGone(t, "oci:"+dir, d, nil) {
					t.Fatalf("after an interruption at %s and a second prune, %s is still there", steps[stop-1], d)
				}
			}
		}
		if !prunetest.ManifestGone(t, "oci:"+dir, cps[0].res.Disk.Digest, nil) {
			t.Fatalf("after an interruption at %s and a second prune, the first disk image is still there", steps[stop-1])
		}
		for _, cp := range cps[2:] {
			restoresExactly(t, overlay, cp, nil)
		}
	}
}

func TestPruneRefusesBadArguments(t *testing.T) {
	dir := t.TempDir()
	for name, s := range map[string]PruneSpec{
		"keep 0":   {Repo: "oci:" + dir, Keep: 0},
		"a tag":    {Repo: "oci:" + dir + ":vm", Keep: 1},
		"a digest": {Repo: "oci:" + dir + "@sha256:" + strings.Repeat("a", 64), Keep: 1},
	} {
		if _, err := Prune(context.Background(), s); errcode.Of(err) != errcode.Usage {
			t.Errorf("%s: %v, want USAGE", name, err)
		}
	}
}

// TestPruneKeepsUndatedCheckpoints: a state manifest without a valid
// creation time is never pruned, whatever --keep says.
func TestPruneKeepsUndatedCheckpoints(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	var ds []string
	for i, created := range []string{"", "2020-01-01T00:00:00Z", "2021-01-01T00:00:00Z"} {
		repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: dir, Tag: []string{"a", "b", "c"}[i]})
		if err != nil {
			t.Fatal(err)
		}
		desc, err := pushTagged(ctx, repo, ociimage.Artifact{
			ArtifactType: ociimage.ArtifactTypeVMState, ConfigMediaType: ociimage.MediaTypeVMStateConfig,
			Config: map[string]int{"n": i}, Annotations: map[string]string{ociimage.AnnotationCreated: created},
		})
		if err != nil {
			t.Fatal(err)
		}
		ds = append(ds, desc.Digest.String())
	}
	res, err := Prune(ctx, PruneSpec{Repo: "oci:" + dir, Keep: 1})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(prunetest.Digests(res.Kept), []string{ds[2], ds[0]}) || !slices.Equal(prunetest.Digests(res.Removed), []string{ds[1]}) || !res.Kept[1].Undated {
		t.Fatalf("kept %+v removed %v", res.Kept, prunetest.Digests(res.Removed))
	}
	if !prunetest.ManifestGone(t, "oci:"+dir, ds[1], nil) || prunetest.ManifestGone(t, "oci:"+dir, ds[0], nil) {
		t.Fatal("the dated old one should be gone, the undated one kept")
	}
}

func received(vm *qmptest.FakeQEMU) []byte {
	vm.Lock()
	defer vm.Unlock()
	return vm.Received
}

// TestPruneKeepsWhatAKeptCheckpointNeeds: a disk image named by both a kept
// and a removed checkpoint stays, and so does an image of the removed one
// in another repository; both are reported as left, with why.
func TestPruneKeepsWhatAKeptCheckpointNeeds(t *testing.T) {
	ctx := context.Background()
	dir, other := t.TempDir(), t.TempDir()
	push := func(layout, tag, artifactType string, config any, annotations map[string]string, subject *ocispec.Descriptor) ocispec.Descriptor {
		t.Helper()
		repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: layout, Tag: tag})
		if err != nil {
			t.Fatal(err)
		}
		cfgType := ociimage.MediaTypeVMStateConfig
		if artifactType == ociimage.ArtifactTypeDisk {
			cfgType = ociimage.MediaTypeDiskConfig
		}
		desc, err := pushTagged(ctx, repo, ociimage.Artifact{ArtifactType: artifactType, ConfigMediaType: cfgType,
			Config: config, Annotations: annotations, Subject: subject})
		if err != nil {
			t.Fatal(err)
		}
		return desc
	}
	disk := push(dir, "", ociimage.ArtifactTypeDisk, map[string]string{"disk": "shared"}, nil, nil)
	elsewhere := push(other, "rootfs", ociimage.ArtifactTypeDisk, map[string]string{"disk": "elsewhere"}, nil, nil)
	diskRef := "oci:" + dir + "@" + disk.Digest.String()
	elsewhereRef := "oci:" + other + "@" + elsewhere.Digest.String()
	old := push(dir, "vm", ociimage.ArtifactTypeVMState, map[string]int{"n": 1}, map[string]string{
		ociimage.AnnotationCreated: "2020-01-01T00:00:00Z", ociimage.AnnotationDiskImage: diskRef, ociimage.AnnotationRootfsImage: elsewhereRef,
	}, &disk)
	kept := push(dir, "vm", ociimage.ArtifactTypeVMState, map[string]int{"n": 2}, map[string]string{
		ociimage.AnnotationCreated: "2021-01-01T00:00:00Z", ociimage.AnnotationDiskImage: diskRef, ociimage.AnnotationPrevious: old.Digest.String(),
	}, &disk)

	res, err := Prune(ctx, PruneSpec{Repo: "oci:" + dir, Keep: 1})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(prunetest.Digests(res.Kept), []string{kept.Digest.String()}) || !slices.Equal(prunetest.Digests(res.Removed), []string{old.Digest.String()}) || len(res.RemovedImages) != 0 {
		t.Fatalf("kept %v removed %v images %+v", prunetest.Digests(res.Kept), prunetest.Digests(res.Removed), res.RemovedImages)
	}
	reasons := map[string]string{}
	for _, l := range res.LeftImages {
		reasons[l.Image] = l.Reason
	}
	if reasons[diskRef] != "a kept checkpoint needs it" || !strings.HasPrefix(reasons[elsewhereRef], "in another repository") {
		t.Fatalf("left %+v", res.LeftImages)
	}
	if prunetest.ManifestGone(t, "oci:"+dir, disk.Digest.String(), nil) || prunetest.ManifestGone(t, "oci:"+other, elsewhere.Digest.String(), nil) {
		t.Fatal("a disk image a kept checkpoint needs, or one in another repository, was deleted")
	}
	for _, b := range blobsOf(t, dir, disk.Digest.String()) {
		if !blobExists(dir, b) {
			t.Fatalf("blob %s of the shared disk image was removed", b)
		}
	}
	if !prunetest.ManifestGone(t, "oci:"+dir, old.Digest.String(), nil) {
		t.Fatal("the old checkpoint is still there")
	}
}

// TestPruneDeletesOnlyWhatTheLinksSayTheyAre: a removed checkpoint whose
// disk annotation names a container image, and whose rootfs annotation
// names a tagged image, gets neither deleted: a state manifest cannot get
// arbitrary images deleted by naming them.
func TestPruneDeletesOnlyWhatTheLinksSayTheyAre(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	push := func(tag, artifactType, cfgType string, config any, annotations map[string]string) ocispec.Descriptor {
		t.Helper()
		repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: dir, Tag: tag})
		if err != nil {
			t.Fatal(err)
		}
		desc, err := pushTagged(ctx, repo, ociimage.Artifact{ArtifactType: artifactType, ConfigMediaType: cfgType, Config: config, Annotations: annotations})
		if err != nil {
			t.Fatal(err)
		}
		return desc
	}
	// ArtifactType "" is refused by PushArtifact; a vmstate config stands
	// in for "some other image".
	victim := push("", ociimage.ArtifactTypeVMState, ociimage.MediaTypeVMStateConfig, map[string]string{"victim": "1"}, nil)
	tagged := push("base", ociimage.ArtifactTypeDisk, ociimage.MediaTypeDiskConfig, map[string]string{"base": "1"}, nil)
	old := push("vm", ociimage.ArtifactTypeVMState, ociimage.MediaTypeVMStateConfig, map[string]int{"n": 1}, map[string]string{
		ociimage.AnnotationCreated:     "2020-01-01T00:00:00Z",
		ociimage.AnnotationDiskImage:   "oci:" + dir + "@" + victim.Digest.String(),
		ociimage.AnnotationRootfsImage: "oci:" + dir + "@" + tagged.Digest.String(),
	})
	push("vm", ociimage.ArtifactTypeVMState, ociimage.MediaTypeVMStateConfig, map[string]int{"n": 2}, map[string]string{
		ociimage.AnnotationCreated: "2021-01-01T00:00:00Z", ociimage.AnnotationPrevious: old.Digest.String(),
	})
	res, err := Prune(ctx, PruneSpec{Repo: "oci:" + dir, Keep: 1})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.RemovedImages) != 0 || len(res.LeftImages) != 2 {
		t.Fatalf("removed %+v, left %+v", res.RemovedImages, res.LeftImages)
	}
	if prunetest.ManifestGone(t, "oci:"+dir, victim.Digest.String(), nil) || prunetest.ManifestGone(t, "oci:"+dir, tagged.Digest.String(), nil) {
		t.Fatal("an image a removed checkpoint merely named was deleted")
	}
	if !prunetest.ManifestGone(t, "oci:"+dir, old.Digest.String(), nil) {
		t.Fatal("the old checkpoint is still there")
	}
}

// TestPruneDeletesOnlyThePartsAnIndexSaysTheyAre: a removed checkpoint
// whose index lists some other VM state image as its disk, and a tagged
// disk image as its rootfs, gets neither deleted: an index, which anyone
// who may push can write, cannot get images deleted by listing them.
func TestPruneDeletesOnlyThePartsAnIndexSaysTheyAre(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: dir})
	if err != nil {
		t.Fatal(err)
	}
	push := func(artifactType, cfgType string, config any) ocispec.Descriptor {
		t.Helper()
		desc, err := ociimage.PushArtifact(ctx, repo, ociimage.Artifact{ArtifactType: artifactType, ConfigMediaType: cfgType, Config: config})
		if err != nil {
			t.Fatal(err)
		}
		return desc
	}
	index := func(parts map[string]ocispec.Descriptor, annotations map[string]string, tag string) ocispec.Descriptor {
		t.Helper()
		d, err := ociimage.PutCheckpoint(ctx, repo, ociimage.CheckpointIndex{Parts: parts, Annotations: annotations})
		if err == nil {
			err = ociimage.TagManifest(ctx, repo, d, tag)
		}
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	victim := push(ociimage.ArtifactTypeVMState, ociimage.MediaTypeVMStateConfig, map[string]string{"victim": "1"})
	tagged := push(ociimage.ArtifactTypeDisk, ociimage.MediaTypeDiskConfig, map[string]string{"base": "1"})
	if err := ociimage.TagManifest(ctx, repo, tagged, "base"); err != nil {
		t.Fatal(err)
	}
	oldState := push(ociimage.ArtifactTypeVMState, ociimage.MediaTypeVMStateConfig, map[string]int{"n": 1})
	old := index(map[string]ocispec.Descriptor{ociimage.PartVMState: oldState, ociimage.PartDisk: victim, ociimage.PartRootfs: tagged},
		map[string]string{ociimage.AnnotationCreated: "2020-01-01T00:00:00Z"}, "vm")
	index(map[string]ocispec.Descriptor{ociimage.PartVMState: push(ociimage.ArtifactTypeVMState, ociimage.MediaTypeVMStateConfig, map[string]int{"n": 2})},
		map[string]string{ociimage.AnnotationCreated: "2021-01-01T00:00:00Z", ociimage.AnnotationPrevious: old.Digest.String()}, "vm")

	res, err := Prune(ctx, PruneSpec{Repo: "oci:" + dir, Keep: 1})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.RemovedImages) != 1 || res.RemovedImages[0].Image != "oci:"+dir+"@"+oldState.Digest.String() || len(res.LeftImages) != 2 {
		t.Fatalf("removed %+v, left %+v; want the old state only, the other two left", res.RemovedImages, res.LeftImages)
	}
	if prunetest.ManifestGone(t, "oci:"+dir, victim.Digest.String(), nil) || prunetest.ManifestGone(t, "oci:"+dir, tagged.Digest.String(), nil) {
		t.Fatal("an image a removed checkpoint merely listed was deleted")
	}
	if !prunetest.ManifestGone(t, "oci:"+dir, old.Digest.String(), nil) || !prunetest.ManifestGone(t, "oci:"+dir, oldState.Digest.String(), nil) {
		t.Fatal("the old checkpoint is still there")
	}
}

// One checkpoint index in the repository that prune cannot read (anyone
// who may push there can write one) is left alone and reported; the
// others' retention goes on.
func TestPruneLeavesAnUnreadableCheckpointAndGoesOn(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	var ds []string
	for i, created := range []string{"2020-01-01T00:00:00Z", "2021-01-01T00:00:00Z"} {
		repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: dir, Tag: []string{"a", "b"}[i]})
		if err != nil {
			t.Fatal(err)
		}
		desc, err := pushTagged(ctx, repo, ociimage.Artifact{
			ArtifactType: ociimage.ArtifactTypeVMState, ConfigMediaType: ociimage.MediaTypeVMStateConfig,
			Config: map[string]int{"n": i}, Annotations: map[string]string{ociimage.AnnotationCreated: created},
		})
		if err != nil {
			t.Fatal(err)
		}
		ds = append(ds, desc.Digest.String())
	}
	// An index with the checkpoint marker listing a part vmsnap does not
	// know, under a tag of its own.
	repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: dir})
	if err != nil {
		t.Fatal(err)
	}
	first, err := repo.ResolveTag(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	first.Annotations = map[string]string{ociimage.AnnotationPart: "bogus"}
	bad, err := repo.PutIndex(ctx, ocispec.Index{Manifests: []ocispec.Descriptor{first},
		Annotations: map[string]string{ociimage.AnnotationCheckpoint: ociimage.ArtifactTypeCheckpoint}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ociimage.TagManifest(ctx, repo, bad, "bad"); err != nil {
		t.Fatal(err)
	}

	res, err := Prune(ctx, PruneSpec{Repo: "oci:" + dir, Keep: 1})
	if err != nil {
		t.Fatalf("prune stopped at the unreadable index: %v", err)
	}
	if !slices.Equal(prunetest.Digests(res.Kept), []string{ds[1]}) || !slices.Equal(prunetest.Digests(res.Removed), []string{ds[0]}) {
		t.Fatalf("kept %v removed %v, want %s kept and %s removed", prunetest.Digests(res.Kept), prunetest.Digests(res.Removed), ds[1], ds[0])
	}
	var reported bool
	for _, l := range res.LeftImages {
		reported = reported || strings.HasSuffix(l.Image, "@"+bad.Digest.String()) && strings.Contains(l.Reason, "cannot read")
	}
	if !reported || prunetest.ManifestGone(t, "oci:"+dir, bad.Digest.String(), nil) {
		t.Fatalf("the unreadable index is not reported as left, or is gone: %+v", res.LeftImages)
	}
}
