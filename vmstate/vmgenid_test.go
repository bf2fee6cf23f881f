package vmstate

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

const sourceGUID = "6f1b9c2e-0d4a-4e8b-9f3c-2a7d5e6b8c01"

// checkpointWithVMGenID stores state from a source whose vmgenid device
// reports guid ("": no device) and returns the image's pinned reference.
func checkpointWithVMGenID(t *testing.T, state []byte, guid string) ociimage.Reference {
	t.Helper()
	src := qmptest.NewFakeQEMU(t, "running", state)
	src.VMGenID = guid
	res, err := Checkpoint(context.Background(), src.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"), CheckpointOptions{Mode: ModePause, Stream: chunk.StreamOptions{ChunkSize: 512 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	return res.Image
}

func TestReadRecordVMGenID(t *testing.T) {
	ctx := context.Background()
	q := qmptest.NewFakeQEMU(t, "running", nil)
	q.VMGenID = strings.ToUpper(sourceGUID)
	r, err := ReadRecord(ctx, q.Dial(t))
	if err != nil || r.VMGenID != sourceGUID {
		t.Fatalf("VMGenID = %q, %v; want %q (lower case)", r.VMGenID, err, sourceGUID)
	}
	none := qmptest.NewFakeQEMU(t, "running", nil)
	if r, err := ReadRecord(ctx, none.Dial(t)); err != nil || r.VMGenID != "" {
		t.Fatalf("without the device: VMGenID = %q, %v; want empty", r.VMGenID, err)
	}
}

// A hostile QEMU's generation ID never reaches a record, and the error
// quoting it stays short.
func TestReadRecordRefusesHostileGenerationID(t *testing.T) {
	for _, guid := range []string{
		"not-a-guid",
		sourceGUID + "\n",
		"../../../../etc/passwd/aaaaaaaaaaaaaaaaaaaaaaaaaaa",
		"6f1b9c2e-0d4a-4e8b-9f3c-2a7d5e6b8c0g",
		strings.Repeat("a", 1<<20),
	} {
		q := qmptest.NewFakeQEMU(t, "running", nil)
		q.VMGenID = guid
		r, err := ReadRecord(context.Background(), q.Dial(t))
		if errcode.Of(err) != errcode.QMPError || r.VMGenID != "" {
			t.Fatalf("guid %.40q: err = %v, VMGenID %.40q; want QMP_ERROR and no ID", guid, err, r.VMGenID)
		}
		if len(err.Error()) > 300 {
			t.Fatalf("the error quotes %d bytes of QEMU's reply", len(err.Error()))
		}
	}
}

func TestCompareRequiresVMGenIDOnTarget(t *testing.T) {
	src, target := sampleRecord(), sampleRecord()
	src.VMGenID = sourceGUID
	diffs := Compare(src, target)
	if len(diffs) != 1 || !strings.Contains(diffs[0], "-device vmgenid,guid=auto") {
		t.Fatalf("diffs = %v; want one naming -device vmgenid,guid=auto", diffs)
	}
	if err := CheckCompatible(src, target); errcode.Of(err) != errcode.CompatMismatch {
		t.Fatalf("err = %v, want COMPAT_MISMATCH", err)
	}
	target.VMGenID = sourceGUID
	if d := Compare(src, target); len(d) != 1 || !strings.Contains(d[0], "not a fixed guid=") {
		t.Fatalf("a target with the source's own ID: diffs %v", d)
	}
	// An ID of the target's own is fine, and a target with the device
	// may load a snapshot of a VM without one.
	target.VMGenID = "00000000-0000-4000-8000-000000000000"
	for _, s := range []Record{src, sampleRecord()} {
		if d := Compare(s, target); len(d) != 0 {
			t.Fatalf("source ID %q, target with the device: diffs %v", s.VMGenID, d)
		}
	}
}

func TestValidateRefusesBadVMGenID(t *testing.T) {
	r := sampleRecord()
	r.VMGenID = sourceGUID
	if err := r.Validate(); err != nil {
		t.Fatalf("a GUID: %v", err)
	}
	for _, bad := range []string{strings.ToUpper(sourceGUID), "x", sourceGUID + " "} {
		r.VMGenID = bad
		if err := r.Validate(); errcode.Of(err) != errcode.InvalidInput {
			t.Fatalf("VMGenID %q: err = %v, want INVALID_INPUT", bad, err)
		}
	}
}

// Two clones restored into targets with IDs of their own (guid=auto) each
// report the ID their guest finds.
func TestRestoreReportsEachClonesGenerationID(t *testing.T) {
	state := chunkdata.Stream(t, 1<<20)
	ref := checkpointWithVMGenID(t, state, sourceGUID)
	for _, id := range []string{"0e8f6a4c-1b2d-4c3e-8f9a-0b1c2d3e4f50", "7a6b5c4d-3e2f-4a1b-9c8d-7e6f5a4b3c2d"} {
		dst := qmptest.NewFakeQEMU(t, "inmigrate", state)
		dst.VMGenID = id
		res, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref.String()), RestoreOptions{})
		if err != nil || res.GenerationID != id || dst.Status() != "running" {
			t.Fatalf("err %v, GenerationID %q, status %s: want the target's %s, running", err, res.GenerationID, dst.Status(), id)
		}
	}
}

// A target started with the source's own fixed guid= would resume a guest
// that does not know it is a copy: refused before a byte is fed.
func TestRestoreRefusesTheSourcesGenerationID(t *testing.T) {
	ref := checkpointWithVMGenID(t, chunkdata.Stream(t, 1<<20), sourceGUID)
	dst := qmptest.NewFakeQEMU(t, "inmigrate", nil)
	dst.VMGenID = strings.ToUpper(sourceGUID)
	_, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref.String()), RestoreOptions{})
	if errcode.Of(err) != errcode.CompatMismatch || !strings.Contains(err.Error(), "not a fixed guid=") {
		t.Fatalf("err = %v, want COMPAT_MISMATCH saying to start the target with guid=auto", err)
	}
	if slices.Contains(dst.Commands(), "migrate-incoming") {
		t.Fatalf("the state was fed to a twin: %v", dst.Commands())
	}
}

func TestRestoreRefusesTargetWithoutVMGenID(t *testing.T) {
	ref := checkpointWithVMGenID(t, chunkdata.Stream(t, 1<<20), sourceGUID)
	dst := qmptest.NewFakeQEMU(t, "inmigrate", nil)
	_, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref.String()), RestoreOptions{})
	if errcode.Of(err) != errcode.CompatMismatch || !strings.Contains(err.Error(), "vmgenid,guid=auto") {
		t.Fatalf("err = %v, want COMPAT_MISMATCH naming -device vmgenid,guid=auto", err)
	}
	if slices.Contains(dst.Commands(), "migrate-incoming") {
		t.Fatalf("the state was fed to a target without vmgenid: %v", dst.Commands())
	}
}

// A snapshot of a VM without the device restores as before, reporting no
// generation ID.
func TestRestoreWithoutVMGenIDSetsNothing(t *testing.T) {
	state := chunkdata.Stream(t, 1<<20)
	ref := checkpointWithVMGenID(t, state, "")
	dst := qmptest.NewFakeQEMU(t, "inmigrate", state)
	res, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref.String()), RestoreOptions{})
	if err != nil || res.GenerationID != "" {
		t.Fatalf("err = %v, GenerationID %q", err, res.GenerationID)
	}
}
