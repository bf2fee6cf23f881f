package vmstate

import (
	"context"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
)

// A tenant's QEMU that ignores remove-fd keeps the staging file of each of
// its mapped-ram checkpoints (each fails, and the file is kept empty). Past
// maxKeptStaging such files the agent made no staging file for anyone: every
// other tenant's mapped-ram restore failed, its checkpoints fell back to the
// stream. Kept files count per owner (the agent's namespace).
func TestStagingFilesKeptByOneOwnersQEMUsDoNotStopAnothers(t *testing.T) {
	state := mappedState(t, 1<<20)
	hostile := mappedSource(t, state)
	hostile.Lock()
	hostile.Version = [3]int{10, 0, 2} // closes a removed fdset's descriptor at once, unless it keeps it
	hostile.Unlock()
	hostile.HoldRemovedFDs(t)
	t.Cleanup(func() { hostile.CloseHeld(); waitNoneKept(t) })
	staging := t.TempDir()
	for i := range maxKeptStaging {
		_, err := Checkpoint(context.Background(), hostile.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"), CheckpointOptions{
			Mode: ModeSnapshot, Format: FormatMappedRAM, StagingDir: staging, StagingOwner: "namespace a", Stream: chunk.StreamOptions{ChunkSize: 1 << 20}})
		if errcode.Of(err) != errcode.QMPError {
			t.Fatalf("checkpoint %d of a QEMU that keeps its staging files: %v, want QMP_ERROR", i, err)
		}
	}
	_, err := Checkpoint(context.Background(), hostile.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"), CheckpointOptions{
		Mode: ModeSnapshot, Format: FormatMappedRAM, StagingDir: staging, StagingOwner: "namespace a", Stream: chunk.StreamOptions{ChunkSize: 1 << 20}})
	if errcode.Of(err) != errcode.Internal || !strings.Contains(err.Error(), "still held") {
		t.Fatalf("the owner's checkpoint past %d kept files: %v; want INTERNAL saying its staging files are still held", maxKeptStaging, err)
	}
	other := mappedSource(t, state)
	res, err := Checkpoint(context.Background(), other.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"), CheckpointOptions{
		Mode: ModeSnapshot, Format: FormatMappedRAM, StagingDir: staging, StagingOwner: "namespace b", Stream: chunk.StreamOptions{ChunkSize: 1 << 20}})
	if err != nil || res.Config.Format != FormatMappedRAM {
		t.Fatalf("another owner's mapped-ram checkpoint while the first's QEMU keeps %d staging files: %v; want it made", maxKeptStaging, err)
	}
}
