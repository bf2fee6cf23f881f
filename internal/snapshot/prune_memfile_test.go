package snapshot

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/vmsnap/vmsnap/qmp/qmptest"
	"github.com/vmsnap/vmsnap/vmstate"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// A delta's manifest lists its parent's region layers: pruning the parent
// deletes its manifest but none of the blobs the kept delta needs, and the
// delta still gives the RAM file back exactly.
func TestPruneKeepsTheLayersAKeptDeltaBuildsOn(t *testing.T) {
	ctx := context.Background()
	const memory = 16 << 20
	ram := filepath.Join(t.TempDir(), "ram")
	if err := os.WriteFile(ram, randomState(t, memory), 0o600); err != nil {
		t.Fatal(err)
	}
	qmptest.MapFile(t, ram) // as QEMU would
	store := t.TempDir()
	var cps []string
	records := &vmstate.ParentRecords{Dir: filepath.Join(t.TempDir(), "records")}
	for i := range 3 {
		if i > 0 { // a page changes between checkpoints
			f, _ := os.OpenFile(ram, os.O_RDWR, 0)
			f.WriteAt(randomState(t, ramfile.PageSize), int64(i)*1<<20)
			f.Close()
		}
		q := qmptest.NewFakeQEMU(t, "running", randomState(t, 64<<10))
		q.Memory = memory
		q.RAMBackend = &qmptest.FakeBackend{ID: "ram0", Type: "memory-backend-file", MemPath: ram, Share: true}
		res, err := Checkpoint(ctx, CheckpointSpec{QMPPath: q.Path(), Image: "oci:" + store + ":vm", StagingDir: t.TempDir(), Records: records})
		if err != nil {
			t.Fatal(err)
		}
		if r := res.VMState.RAM; r == nil || len(r.Chain) != i+1 {
			t.Fatalf("checkpoint %d: chain %+v, want %d links", i, r, i+1)
		}
		cps = append(cps, res.VMState.Image)
	}
	pr, err := Prune(ctx, PruneSpec{Repo: "oci:" + store, Keep: 1})
	if err != nil {
		t.Fatal(err)
	}
	if len(pr.Removed) != 2 {
		t.Fatalf("pruned %d checkpoints, want the 2 older ones: %+v", len(pr.Removed), pr)
	}
	for _, old := range cps[:2] {
		if _, err := Prepare(ctx, PrepareSpec{Image: old, CacheDir: filepath.Join(t.TempDir(), "c")}); err == nil {
			t.Errorf("the pruned checkpoint %s still prepares", old)
		}
	}
	p, err := Prepare(ctx, PrepareSpec{Image: cps[2], CacheDir: filepath.Join(t.TempDir(), "cache")})
	if err != nil {
		t.Fatalf("the kept delta no longer prepares after its parents were pruned: %v", err)
	}
	got, _ := os.ReadFile(p.MemoryFile)
	want, _ := os.ReadFile(ram)
	if !bytes.Equal(got, want) {
		t.Fatal("the kept delta does not give the RAM file back")
	}
}
