package agent

import (
	"bytes"
	"context"
	"io/fs"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// TestAgentRefusesWorkersAndChunksOverItsBounds: a request's workers above
// --max-workers, or its chunk size above 16 MiB, is refused before
// anything is resolved, with INVALID_INPUT naming the bound; at the bound
// it runs. An agent cannot be configured above the hard cap.
func TestAgentRefusesWorkersAndChunksOverItsBounds(t *testing.T) {
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20))
	res := newStaticResolver()
	res.add(uid1, vm.Path())
	a := startAgentConfig(t, Config{StateDir: t.TempDir(), Resolver: res, MaxWorkers: 3})
	ctx := context.Background()
	ref := api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/run/vm/qmp.sock"}
	image := "oci:" + t.TempDir() + ":vm"

	for _, req := range []api.CheckpointRequest{
		{VM: ref, Image: image, Workers: 4},
		{VM: ref, Image: image, Workers: 1000},
		{VM: ref, Image: image, Workers: -1},
		{VM: ref, Image: image, ChunkSize: 32 << 20},
	} {
		_, err := a.client.Checkpoint(ctx, req)
		if errcode.Of(err) != errcode.InvalidInput || !strings.Contains(err.Error(), "leave it out for the default") {
			t.Fatalf("checkpoint with workers %d, chunk size %d: %v, want INVALID_INPUT", req.Workers, req.ChunkSize, err)
		}
		if req.Workers > 3 && !strings.Contains(err.Error(), "1..3 (its --max-workers)") {
			t.Fatalf("the refusal does not name the bound: %v", err)
		}
	}
	_, err := a.client.Restore(ctx, api.RestoreRequest{VM: ref, Image: "oci:/x@sha256:" + strings.Repeat("0", 64), Workers: 4})
	if errcode.Of(err) != errcode.InvalidInput {
		t.Fatalf("restore with 4 workers: %v, want INVALID_INPUT", err)
	}
	if res.calls != 0 {
		t.Fatalf("refused requests were resolved %d times", res.calls)
	}
	if len(vm.Commands()) != 0 {
		t.Fatalf("refused requests reached QEMU: %v", vm.Commands())
	}
	op, err := a.client.Checkpoint(ctx, api.CheckpointRequest{VM: ref, Image: image, Workers: 3, ChunkSize: 16 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if final := waitOp(t, a.client, op.ID); final.State != api.StateSucceeded {
		t.Fatalf("a checkpoint at the bounds: %+v", final.Error)
	}

	_, err = New(ctx, Config{StateDir: t.TempDir(), Resolver: res, MaxWorkers: HardMaxWorkers + 1})
	if errcode.Of(err) != errcode.Usage {
		t.Fatalf("an agent with --max-workers %d: %v, want USAGE", HardMaxWorkers+1, err)
	}
}

// TestAgentOperationTimeout: a QEMU that greets and never answers holds an
// operation only until --operation-timeout: it fails with QMP_ERROR saying
// so, the in-flight gauges go back to 0, and the VM is free again. A QEMU
// that never greets (another client holds its monitor) fails the operation
// by its deadline (Dial's own greeting timeout, 10s, is longer than this
// test's operation timeout), BUSY, with a message that says why.
func TestAgentOperationTimeout(t *testing.T) {
	silent := qmptest.NewHostile(t, qmptest.GreetsThenSilent)
	mute := qmptest.NewHostile(t, qmptest.NeverGreets)
	const uid2 = "6f1c2a4e-2222-4c0e-9a51-0123456789ab"
	res := newStaticResolver()
	res.add(uid1, silent.Path())
	res.add(uid2, mute.Path())
	const timeout = 2 * time.Second
	a := startAgentConfig(t, Config{StateDir: t.TempDir(), Resolver: res, OperationTimeout: timeout})
	ctx := context.Background()

	start := time.Now()
	req := api.CheckpointRequest{VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/run/vm/qmp.sock"}, Image: "oci:" + t.TempDir() + ":vm"}
	op, err := a.client.Checkpoint(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	final := waitOp(t, a.client, op.ID)
	elapsed := time.Since(start)
	if final.State != api.StateFailed || final.Error.Code != errcode.QMPError || !strings.Contains(final.Error.Message, "--operation-timeout of 2s") {
		t.Fatalf("an operation on a QEMU that never answers: %s %+v, want failed, QMP_ERROR, naming the timeout", final.State, final.Error)
	}
	// The QEMU never answers: the message names what ended the operation.
	if elapsed < timeout {
		t.Fatalf("the operation ended after %v, before its %v timeout", elapsed, timeout)
	}
	for _, state := range []string{api.StatePending, api.StateRunning} {
		if v := gauge(t, a.srv, "vmsnap_operations_in_flight", api.KindCheckpoint, state); v != 0 {
			t.Fatalf("vmsnap_operations_in_flight{state=%q} is %v after the timeout", state, v)
		}
	}
	if entries, _ := a.srv.journal.list(); len(entries) != 0 {
		t.Fatalf("the journal still holds %d entries", len(entries))
	}
	// The VM is free: the next request is not BUSY.
	if _, err := a.client.Checkpoint(ctx, req); err != nil {
		t.Fatalf("a second checkpoint after the timeout: %v", err)
	}

	start = time.Now()
	req.VM.PodUID = uid2
	op, err = a.client.Checkpoint(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	final = waitOp(t, a.client, op.ID)
	if final.State != api.StateFailed || final.Error.Code != errcode.Busy || !strings.Contains(final.Error.Message, "another client probably holds the monitor") {
		t.Fatalf("an operation on a QEMU that never greets: %s %+v", final.State, final.Error)
	}
	if d := time.Since(start); d > timeout+3*time.Second {
		t.Fatalf("a QEMU that never greets held the operation %v", d)
	}
}

// lockedBuffer is a log destination safe to read while the agent writes.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestAgentVMGoneLogsCancelOnlyForRunningOperations: when a VM's container
// goes away, the agent logs "cancelling its operation" for an operation
// still running, and not for one that had already finished (which it
// forgets quietly, at debug level).
func TestAgentVMGoneLogsCancelOnlyForRunningOperations(t *testing.T) {
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20))
	silent := qmptest.NewHostile(t, qmptest.GreetsThenSilent)
	const uid2 = "6f1c2a4e-2222-4c0e-9a51-0123456789ab"
	res := newStaticResolver()
	res.add(uid1, vm.Path())
	res.add(uid2, silent.Path())
	logs := &lockedBuffer{}
	log := slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	a := startAgentConfig(t, Config{StateDir: t.TempDir(), Resolver: res, Logger: log})
	ctx := context.Background()
	image := "oci:" + t.TempDir() + ":vm"

	done, err := a.client.Checkpoint(ctx, api.CheckpointRequest{VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/q"}, Image: image})
	if err != nil {
		t.Fatal(err)
	}
	if final := waitOp(t, a.client, done.ID); final.State != api.StateSucceeded {
		t.Fatalf("checkpoint: %+v", final.Error)
	}
	running, err := a.client.Checkpoint(ctx, api.CheckpointRequest{VM: api.VMRef{PodUID: uid2, Container: "qemu", QMPPath: "/q"}, Image: image})
	if err != nil {
		t.Fatal(err)
	}
	waitState(t, a.client, running.ID, api.StateRunning)

	res.delete(uid1)
	res.delete(uid2)
	for _, id := range []string{done.ID, running.ID} {
		waitForgotten(t, a.client, id)
	}
	lines := map[string][]string{} // by op id
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, "VM gone") {
			for _, id := range []string{done.ID, running.ID} {
				if strings.Contains(l, id) {
					lines[id] = append(lines[id], l)
				}
			}
		}
	}
	if l := lines[done.ID]; len(l) != 1 || strings.Contains(l[0], "cancelling") || !strings.Contains(l[0], "forgetting its finished operation") || !strings.Contains(l[0], `"level":"DEBUG"`) {
		t.Errorf("log of the finished operation's VM going away: %q", l)
	}
	if l := lines[running.ID]; len(l) != 1 || !strings.Contains(l[0], "VM gone: cancelling its operation") || !strings.Contains(l[0], `"level":"INFO"`) {
		t.Errorf("log of the running operation's VM going away: %q", l)
	}
}

func waitState(t *testing.T, c *Client, id, state string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		o, err := c.Get(context.Background(), id)
		if err == nil && o.State == state {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("operation %s: %+v, %v; want %s", id, o, err, state)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func waitForgotten(t *testing.T, c *Client, id string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := c.Get(context.Background(), id)
		if errcode.Of(err) == errcode.VMNotFound {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("operation %s is still known: %v", id, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// gauge reads one series of a gauge from the agent's registry: the one
// whose label values are values, in any order (0 if there is none).
func gauge(t *testing.T, s *Server, name string, values ...string) float64 {
	t.Helper()
	families, err := s.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			for _, v := range values {
				if !slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return l.GetValue() == v }) {
					continue series
				}
			}
			return m.GetGauge().GetValue()
		}
	}
	return 0
}

// TestAgentMappedRAMStagingBounded: through the agent (its state directory
// is the staging directory), a QEMU that claims 16 MiB of memory and writes
// its mapped-ram file without end is stopped near the bound: the operation
// fails with QMP_ERROR, the VM runs again, the state directory holds no
// staging file and the file QEMU still holds takes no space.
func TestAgentMappedRAMStagingBounded(t *testing.T) {
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 4<<20))
	vm.EnableMappedRAM()
	vm.HoldRemovedFDs(t)
	vm.Lock()
	vm.Memory, vm.LieGrow = 16<<20, true
	vm.Unlock()
	res := newStaticResolver()
	res.add(uid1, vm.Path())
	stateDir := t.TempDir()
	a := startAgentConfig(t, Config{StateDir: stateDir, Resolver: res})
	op, err := a.client.Checkpoint(context.Background(), api.CheckpointRequest{
		VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/q"}, Image: "oci:" + t.TempDir() + ":vm", Mode: "snapshot"})
	if err != nil {
		t.Fatal(err)
	}
	final := waitOp(t, a.client, op.ID)
	if final.State != api.StateFailed || final.Error.Code != errcode.QMPError || !strings.Contains(final.Error.Message, "whose state takes at most 273 MiB") {
		t.Fatalf("checkpoint of a QEMU whose staging file grows without end: %s %+v", final.State, final.Error)
	}
	if vm.Status() != "running" {
		t.Fatalf("the VM is %s, want running", vm.Status())
	}
	vm.WaitMigrations()
	vm.Lock()
	size := vm.FileMaxSize
	vm.Unlock()
	t.Logf("the staging file reached %d MiB before it was freed", size>>20)
	if size < 273<<20 || size > (273+512)<<20 {
		t.Fatalf("the staging file reached %d MiB: want just past the 273 MiB bound", size>>20)
	}
	files, err := vm.HeldFiles()
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range files {
		if h.Size != 0 || h.Allocated != 0 {
			t.Fatalf("QEMU holds a staging file of %d bytes (%d allocated)", h.Size, h.Allocated)
		}
	}
	err = filepath.WalkDir(stateDir, func(path string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			t.Errorf("the state directory holds %s", path)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}
