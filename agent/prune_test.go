package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/internal/testing/prunetest"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// TestAgentCheckpointWithKeepPrunes: the agent prunes after a checkpoint
// whose request has keep, or by its --keep default, and says what went in
// the operation's result.
func TestAgentCheckpointWithKeepPrunes(t *testing.T) {
	state := randomState(t, 1<<20)
	vm := qmptest.NewFakeQEMU(t, "running", state)
	res := newStaticResolver()
	res.add(uid1, vm.Path())
	a := startAgentConfig(t, Config{StateDir: t.TempDir(), Resolver: res, MaxConcurrent: 1, Keep: 2})
	store := t.TempDir()
	ctx := context.Background()
	var done []api.Operation
	for _, keep := range []int{0, 0, 0, 1} {
		op, err := a.client.Checkpoint(ctx, api.CheckpointRequest{
			VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/run/vm/qmp.sock"}, Image: "oci:" + store + ":vm", Keep: keep,
		})
		if err != nil {
			t.Fatal(err)
		}
		final := waitOp(t, a.client, op.ID)
		if final.State != api.StateSucceeded || final.Checkpoint == nil || final.Checkpoint.Pruned == nil || final.Checkpoint.Pruned.Error != nil {
			t.Fatalf("checkpoint %+v", final)
		}
		done = append(done, final)
	}
	digest := func(i int) string { return done[i].Checkpoint.Checkpoint.Digest }
	// A negative keep is refused before anything runs.
	resp, err := a.client.http.Post("http://agent/v1/checkpoints", "application/json",
		strings.NewReader(`{"vm":{"podUID":"`+uid1+`","container":"qemu","qmp":"/run/vm/qmp.sock"},"image":"oci:`+store+`:vm","keep":-1}`))
	if err != nil {
		t.Fatal(err)
	}
	var doc api.ErrorDoc
	_ = json.NewDecoder(resp.Body).Decode(&doc)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest || doc.Error.Code != errcode.InvalidInput {
		t.Fatalf("keep -1: %d %+v, want 400 INVALID_INPUT", resp.StatusCode, doc.Error)
	}
	// The agent's default, 2: the third checkpoint removed the first.
	if p := done[2].Checkpoint.Pruned; p.Keep != 2 || !slices.Equal(prunetest.Digests(p.Removed), []string{digest(0)}) || !slices.Equal(prunetest.Digests(p.Kept), []string{digest(2), digest(1)}) {
		t.Fatalf("the third checkpoint pruned %+v", p)
	}
	// The request's keep, 1: the fourth removed the second and third.
	if p := done[3].Checkpoint.Pruned; p.Keep != 1 || !slices.Equal(prunetest.Digests(p.Removed), []string{digest(2), digest(1)}) {
		t.Fatalf("the fourth checkpoint pruned %+v", p)
	}
	for i := range 3 {
		if !prunetest.ManifestGone(t, "oci:"+store, digest(i), nil) {
			t.Fatalf("checkpoint %d is still stored", i)
		}
	}
	restoresExactlyState(t, done[3].Checkpoint.VMState.Image, state)
}

func restoresExactlyState(t *testing.T, image string, state []byte) {
	t.Helper()
	target := qmptest.NewFakeQEMU(t, "inmigrate", state)
	if _, err := snapshot.RestoreState(context.Background(), snapshot.RestoreSpec{QMPPath: target.Path(), Image: image}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(received(target), state) {
		t.Fatal("the restored state differs")
	}
}

func received(vm *qmptest.FakeQEMU) []byte {
	vm.Lock()
	defer vm.Unlock()
	return vm.Received
}
