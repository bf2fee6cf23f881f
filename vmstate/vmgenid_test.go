package vmstate

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
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
	// Any other ID on the target is fine (the restore replaces it), and
	// a target with the device may load a snapshot of a VM without one.
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

// Two clones restored into targets started with the source's own fixed
// guid= (the worst case: a command line copied from the source) each get a
// fresh ID of their own before they run.
func TestRestoreGivesEachCloneAFreshGenerationID(t *testing.T) {
	state := testStream(t, 1<<20)
	ref := checkpointWithVMGenID(t, state, sourceGUID)
	seen := map[string]bool{sourceGUID: true}
	for range 2 {
		dst := qmptest.NewFakeQEMU(t, "inmigrate", state)
		dst.VMGenID = sourceGUID
		res, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref.String()), RestoreOptions{})
		if err != nil {
			t.Fatal(err)
		}
		dst.Lock()
		got, sets := dst.VMGenID, dst.VMGenIDSets
		dst.Unlock()
		if seen[got] || got != res.GenerationID || sets != 1 {
			t.Fatalf("target's ID %s (result %s, %d sets): want one fresh ID, not one of %v", got, res.GenerationID, sets, seen)
		}
		if _, err := checkGUID(got, "test"); err != nil {
			t.Fatal(err)
		}
		seen[got] = true
		if cmds := dst.Commands(); slices.Index(cmds, "qom-set") > slices.Index(cmds, "cont") {
			t.Fatalf("the ID was set after the VM was continued: %v", cmds)
		}
	}
}

func TestRestoreRefusesTargetWithoutVMGenID(t *testing.T) {
	ref := checkpointWithVMGenID(t, testStream(t, 1<<20), sourceGUID)
	dst := qmptest.NewFakeQEMU(t, "inmigrate", nil)
	_, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref.String()), RestoreOptions{})
	if errcode.Of(err) != errcode.CompatMismatch || !strings.Contains(err.Error(), "vmgenid,guid=auto") {
		t.Fatalf("err = %v, want COMPAT_MISMATCH naming -device vmgenid,guid=auto", err)
	}
	if slices.Contains(dst.Commands(), "migrate-incoming") {
		t.Fatalf("the state was fed to a target without vmgenid: %v", dst.Commands())
	}
}

// A QEMU that does not take the new ID leaves the clone stopped: it never
// runs as a twin.
func TestRestoreLeavesATwinStopped(t *testing.T) {
	state := testStream(t, 1<<20)
	ref := checkpointWithVMGenID(t, state, sourceGUID)
	dst := qmptest.NewFakeQEMU(t, "inmigrate", state)
	dst.VMGenID, dst.VMGenIDIgnoresSet = sourceGUID, true
	_, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref.String()), RestoreOptions{})
	if errcode.Of(err) != errcode.QMPError || slices.Contains(dst.Commands(), "cont") || dst.Status() == "running" {
		t.Fatalf("err = %v, status %s, commands %v; want QMP_ERROR and no cont", err, dst.Status(), dst.Commands())
	}
}

// A snapshot of a VM without the device restores as before: no vmgenid
// command beyond the record's query.
func TestRestoreWithoutVMGenIDSetsNothing(t *testing.T) {
	state := testStream(t, 1<<20)
	ref := checkpointWithVMGenID(t, state, "")
	dst := qmptest.NewFakeQEMU(t, "inmigrate", state)
	res, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref.String()), RestoreOptions{})
	if err != nil || res.GenerationID != "" || slices.Contains(dst.Commands(), "qom-set") {
		t.Fatalf("err = %v, GenerationID %q, commands %v", err, res.GenerationID, dst.Commands())
	}
}

// QEMU loading by itself (-incoming exec:) is finished by FinishIncoming,
// which gives the guest a fresh ID too.
func TestFinishIncomingGivesAFreshGenerationID(t *testing.T) {
	q := qmptest.NewFakeQEMU(t, "paused", nil)
	q.VMGenID = sourceGUID
	running, err := FinishIncoming(context.Background(), q.Dial(t), false)
	q.Lock()
	got := q.VMGenID
	q.Unlock()
	if err != nil || !running || got == sourceGUID {
		t.Fatalf("running %v, err %v, ID %s: want a running VM with a fresh ID", running, err, got)
	}
}
