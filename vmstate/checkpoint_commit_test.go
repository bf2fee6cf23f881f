package vmstate

import (
	"context"
	"errors"
	"strings"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// Commit runs once the state manifest and the checkpoint index listing it
// are stored (by digest, into an untagged repository) and moves the tag;
// without Commit nothing is tagged.
func TestCheckpointCommitMovesTheTagLast(t *testing.T) {
	q := qmptest.NewFakeQEMU(t, "running", chunkdata.Stream(t, 1<<20))
	dir := t.TempDir()
	untagged := openLayout(t, "oci:"+dir)
	var committed ocispec.Descriptor
	res, err := Checkpoint(context.Background(), q.Dial(t), untagged, CheckpointOptions{
		Mode: ModePause,
		Commit: func(ctx context.Context, checkpoint ocispec.Descriptor) error {
			// The index and the manifest it lists are stored whole, and
			// not tagged yet.
			state, _, err := ociimage.OpenPart(ctx, ociimage.Reference{Layout: dir, Digest: checkpoint.Digest}, ociimage.PartVMState)
			if err != nil {
				return err
			}
			if _, _, _, err := LoadConfig(ctx, state); err != nil {
				return err
			}
			if _, err := openLayout(t, "oci:"+dir+":vm").Resolve(ctx); err == nil {
				t.Error("the checkpoint was tagged before Commit")
			}
			committed = checkpoint
			return ociimage.TagManifest(ctx, untagged, checkpoint, "vm")
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if committed.Digest != res.Checkpoint.Digest || !res.Image.IsDigest() || res.Image.Digest != res.Manifest.Digest || res.CheckpointImage.Digest != committed.Digest {
		t.Fatalf("committed %s, result %s (%s, checkpoint %s)", committed.Digest, res.Manifest.Digest, res.Image, res.CheckpointImage)
	}
	if d, err := openLayout(t, "oci:"+dir+":vm").Resolve(context.Background()); err != nil || d.Digest != res.Checkpoint.Digest {
		t.Fatalf("the tag names %v, %v", d.Digest, err)
	}
}

// A Commit that fails fails the checkpoint: the VM runs again.
func TestCheckpointCommitFailureContinuesVM(t *testing.T) {
	q := qmptest.NewFakeQEMU(t, "running", chunkdata.Stream(t, 1<<20))
	commitErr := errcode.New(errcode.AuthFailed, "no push to that tag")
	res, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()), CheckpointOptions{
		Mode:   ModePause,
		Commit: func(context.Context, ocispec.Descriptor) error { return commitErr },
	})
	if res != nil || !errors.Is(err, commitErr) || errcode.Of(err) != errcode.AuthFailed || !strings.Contains(err.Error(), "the VM was continued") {
		t.Fatalf("checkpoint with a failing commit: %+v, %v", res, err)
	}
	if q.Status() != "running" {
		t.Fatalf("VM is %s, want running", q.Status())
	}
}
