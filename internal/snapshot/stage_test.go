package snapshot

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
	"github.com/vmsnap/vmsnap/vmstate"
)

// checkpointToLayout stores a fake VM's state in a layout and returns the
// pinned reference.
func checkpointToLayout(t *testing.T, state []byte) (string, string) {
	t.Helper()
	vm := qmptest.NewFakeQEMU(t, "running", state)
	store := t.TempDir()
	res, err := Checkpoint(context.Background(), CheckpointSpec{
		QMPPath: vm.Path(), Image: "oci:" + store + ":vm", Stream: chunk.StreamOptions{ChunkSize: 256 << 10},
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
	if err := StreamStaged(context.Background(), dir, &out, chunk.StreamOptions{}); err != nil {
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
	err = StreamStaged(context.Background(), dir, &out, chunk.StreamOptions{})
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
