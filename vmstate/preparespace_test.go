package vmstate

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// The agent's RAM caches are in its --state-dir, beside the staging files
// that running operations reserved room for. A prepare checked only the
// free space, so a tenant's prepare could fill the room another tenant's
// checkpoint had reserved, which then failed for want of space. A fill
// reserves what the file may allocate (its declared data and a region,
// Materialize's bound) on the cache's filesystem, as a staging file does.
func TestPrepareReservesItsRoomBesideRunningOperations(t *testing.T) {
	q, _ := fakeFileVM(t) // 4 MiB of data
	layout := t.TempDir()
	res, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+layout+":vm"), CheckpointOptions{Mode: ModePause, StagingDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	ref := "oci:" + layout + "@" + res.Manifest.Digest.String()
	stateDir := t.TempDir()
	fakeFree(t, 12<<20)
	// Another tenant's checkpoint stages on the same filesystem.
	release, err := reserveStaging(filepath.Join(stateDir), 8<<20, false, "")
	if err != nil {
		t.Fatal(err)
	}
	cache := ramfile.Cache{Dir: filepath.Join(stateDir, "ram", "tenant-a")}
	_, err = Prepare(context.Background(), openLayout(t, ref), PrepareOptions{Cache: cache})
	if errcode.Of(err) != errcode.Internal || !strings.Contains(err.Error(), "MiB free") {
		t.Fatalf("a prepare of 4 MiB of data (6 MiB with a region) with 12 MiB free, 8 MiB of it reserved by a running operation: %v; want INTERNAL saying how much is free", err)
	}
	release()
	p, err := Prepare(context.Background(), openLayout(t, ref), PrepareOptions{Cache: cache})
	if err != nil {
		t.Fatalf("once the other operation released its room: %v", err)
	}
	// The room is the fill's only while it fills: the next may take it.
	again, err := reserveStaging(stateDir, 12<<20, false, "")
	if err != nil {
		t.Fatalf("after the prepare (%s), its reservation is still held: %v", p.MemoryFile, err)
	}
	again()
}
