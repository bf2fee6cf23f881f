package vmstate

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// waitHeldEmpty waits (a minute at most: a liveness bound, not a
// measurement) until every file q holds is empty, and fails t otherwise.
func waitHeldEmpty(t *testing.T, q *qmptest.FakeQEMU, what string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		files, err := q.HeldFiles()
		if err != nil {
			t.Fatal(err)
		}
		var held int64
		for _, h := range files {
			held += max(h.Size, h.Allocated)
		}
		if held == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: QEMU's staging file still holds %d MiB: nothing bounds it any more", what, held>>20)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitNoneKept waits until no staging file is watched after its operation.
func waitNoneKept(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		stagingSpace.Lock()
		kept := len(stagingSpace.kept)
		stagingSpace.Unlock()
		if kept == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d staging files are still watched after QEMU closed them", kept)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A QEMU that ignores remove-fd keeps a writable descriptor of its
// staging file after the checkpoint, and goes on writing: the checkpoint
// fails, untagged, the VM running, and the file is kept empty whatever
// QEMU writes, until QEMU closes it.
func TestMappedRAMCheckpointFailsWhenQEMUKeepsItsStagingFile(t *testing.T) {
	q := mappedSource(t, mappedState(t, 4<<20))
	q.Lock()
	q.Version = [3]int{10, 0, 2} // closes a removed fdset's descriptor at once
	q.Unlock()
	q.HoldRemovedFDs(t)
	store := t.TempDir()
	_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+store+":vm"),
		CheckpointOptions{Mode: ModeSnapshot, Format: FormatMappedRAM, StagingDir: t.TempDir(), Stream: chunk.StreamOptions{ChunkSize: 1 << 20}})
	if errcode.Of(err) != errcode.QMPError || !strings.Contains(err.Error(), "open for writing") {
		t.Fatalf("a checkpoint whose QEMU kept its staging file: %v; want QMP_ERROR saying so", err)
	}
	if _, err := openLayout(t, "oci:"+store+":vm").Resolve(context.Background()); err == nil {
		t.Fatal("the failed checkpoint left a tag")
	}
	if q.Status() != "running" {
		t.Fatalf("the VM is %s, want running", q.Status())
	}
	keptEmpty(t, q)
}

// keptEmpty has q write into the staging file it kept, twice, and waits
// for the file to be emptied each time; then q lets go, and the watch
// ends.
func keptEmpty(t *testing.T, q *qmptest.FakeQEMU) {
	t.Helper()
	q.WaitMigrations()
	for i := range 2 {
		if err := q.WriteHeld(64 << 20); err != nil {
			t.Fatal(err)
		}
		waitHeldEmpty(t, q, "after the operation, write "+string(rune('1'+i)))
	}
	q.CloseHeld()
	waitNoneKept(t)
}

// A restore target gets its staging file read-only; one that holds it
// open for writing after the load (reopened, as a privileged QEMU can)
// fails the restore, and its writes are emptied until it lets go. One that
// keeps it only for reading, as QEMU 9.0 does with a paused VM, is let be.
func TestMappedRAMRestoreFailsWhenQEMUWritesItsStagingFile(t *testing.T) {
	state := mappedState(t, 4<<20)
	_, ref := checkpointMappedInto(t, state)
	for _, upgrade := range []bool{false, true} {
		dst := qmptest.NewFakeQEMU(t, "inmigrate", state)
		dst.EnableMappedRAM()
		dst.HoldRemovedFDs(t)
		dst.Lock()
		dst.UpgradeHeld = upgrade
		dst.Unlock()
		_, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref), RestoreOptions{Paused: true, StagingDir: t.TempDir()})
		if !upgrade {
			if err != nil {
				t.Fatalf("a target that keeps reading its staging file: %v", err)
			}
			dst.CloseHeld()
			continue
		}
		if errcode.Of(err) != errcode.QMPError || !strings.Contains(err.Error(), "open for writing") {
			t.Fatalf("a target that holds its staging file for writing: %v; want QMP_ERROR saying so", err)
		}
		keptEmpty(t, dst)
	}
	waitNoneKept(t)
}
