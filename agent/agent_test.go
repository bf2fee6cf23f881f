package agent

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// staticResolver maps pod UIDs to fake VMs and reports deletions on demand.
type staticResolver struct {
	mu    sync.Mutex
	vms   map[string]api.Target // by pod UID
	gone  chan Gone
	calls int
}

func newStaticResolver() *staticResolver {
	return &staticResolver{vms: map[string]api.Target{}, gone: make(chan Gone, 16)}
}

func (r *staticResolver) add(uid, qmpPath string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.vms[uid] = api.Target{PodUID: uid, Container: "qemu", ContainerID: "c-" + uid, QMPPath: qmpPath}
}

func (r *staticResolver) delete(uid string) {
	r.mu.Lock()
	t := r.vms[uid]
	delete(r.vms, uid)
	r.mu.Unlock()
	r.gone <- Gone{PodUID: uid, Container: t.Container, ContainerID: t.ContainerID}
}

// Resolve opens the target's host paths as they are: the tests own them.
func (r *staticResolver) Resolve(_ context.Context, ref VMRef) (*Resolved, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls++
	t, ok := r.vms[ref.PodUID]
	if !ok || ref.Container != t.Container {
		return nil, errcode.New(errcode.VMNotFound, "no container %s in pod %s on this node", ref.Container, ref.PodUID)
	}
	h, err := snapshot.OpenLocal(t.QMPPath, t.DiskPath)
	if err != nil {
		return nil, err
	}
	return &Resolved{Target: t, Handles: *h}, nil
}

func (r *staticResolver) Watch(ctx context.Context) (<-chan Gone, error) {
	out := make(chan Gone)
	go func() {
		defer close(out)
		for {
			select {
			case g := <-r.gone:
				select {
				case out <- g:
				case <-ctx.Done():
					return
				}
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}

type testAgent struct {
	srv      *Server
	client   *Client
	resolver *staticResolver
	stateDir string
	socket   string
	stop     func()
}

func startAgent(t testing.TB, stateDir string, resolver *staticResolver, maxConcurrent int) *testAgent {
	t.Helper()
	return startAgentConfig(t, Config{StateDir: stateDir, Resolver: resolver, MaxConcurrent: maxConcurrent})
}

// startAgentConfig runs an agent with cfg on a socket made here (short
// enough for a unix socket path), waits until it answers, and stops it at
// the end of the test. Logs are discarded unless cfg has a Logger.
func startAgentConfig(t testing.TB, cfg Config) *testAgent {
	t.Helper()
	dir, err := os.MkdirTemp("", "vmsnap-agent-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg.Socket = filepath.Join(dir, "agent.sock")
	if cfg.LayoutRoot == "" {
		// The tests' layouts are t.TempDir()s: siblings under the test's
		// own temporary directory, as the state directory is.
		cfg.LayoutRoot = filepath.Dir(t.TempDir())
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	srv, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	client, err := NewClient("unix://" + cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for client.Health(context.Background()) != nil {
		if time.Now().After(deadline) {
			t.Fatal("agent did not come up")
		}
		time.Sleep(10 * time.Millisecond)
	}
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cancel()
			<-done
		}
	}
	t.Cleanup(stop)
	r, _ := cfg.Resolver.(*staticResolver)
	return &testAgent{srv: srv, client: client, resolver: r, stateDir: cfg.StateDir, socket: cfg.Socket, stop: stop}
}

func randomState(t testing.TB, n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b[:n/2])
	return b
}

const uid1 = "6f1c2a4e-1111-4c0e-9a51-0123456789ab"

// Pods of the recovery tests.
const (
	uid3 = "6f1c2a4e-3333-4c0e-9a51-0123456789ab"
	uid4 = "6f1c2a4e-4444-4c0e-9a51-0123456789ab"
)

func waitOp(t testing.TB, c *Client, id string) api.Operation {
	t.Helper()
	// A guard against a hang only: operations under -race on a loaded
	// machine take what they take.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	o, err := c.Wait(ctx, id, nil)
	if err != nil {
		t.Fatalf("waiting for %s: %v", id, err)
	}
	return o
}

func TestAgentCheckpointAndRestore(t *testing.T) {
	state := randomState(t, 3<<20)
	vm := qmptest.NewFakeQEMU(t, "running", state)
	res := newStaticResolver()
	res.add(uid1, vm.Path())
	a := startAgent(t, t.TempDir(), res, 2)
	store := t.TempDir()

	ctx := context.Background()
	var seen []string
	op, err := a.client.Checkpoint(ctx, api.CheckpointRequest{
		VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/run/vm/qmp.sock"}, Image: "oci:" + store + ":vm", Mode: "pause",
	})
	if err != nil {
		t.Fatal(err)
	}
	final, err := a.client.Wait(ctx, op.ID, func(o api.Operation) { seen = append(seen, o.State) })
	if err != nil || final.State != api.StateSucceeded || final.Checkpoint == nil {
		t.Fatalf("checkpoint ended %+v, %v", final, err)
	}
	if final.Checkpoint.VMRunning || vm.Status() == "running" {
		t.Fatal("pause mode through the agent left the VM running")
	}
	if !strings.Contains(final.Checkpoint.VMState.Image, "@sha256:") || final.Checkpoint.VMState.RawBytes != int64(len(state)) {
		t.Fatalf("result %+v", final.Checkpoint.VMState)
	}
	if seen[len(seen)-1] != api.StateSucceeded {
		t.Fatalf("events seen %v", seen)
	}
	if entries, _ := a.srv.journal.list(); len(entries) != 0 {
		t.Fatalf("journal still holds %d entries after success", len(entries))
	}

	// Restore into a new pod's waiting QEMU, named by the checkpoint (its
	// index): the agent takes the state from it, and the result names the
	// new endpoint.
	const uid2 = "6f1c2a4e-2222-4c0e-9a51-0123456789ab"
	target := qmptest.NewFakeQEMU(t, "inmigrate", state)
	res.add(uid2, target.Path())
	index := final.Checkpoint.Checkpoint.Image
	rop, err := a.client.Restore(ctx, api.RestoreRequest{VM: api.VMRef{PodUID: uid2, Container: "qemu", QMPPath: "/run/vm/qmp.sock"}, Image: index})
	if err != nil {
		t.Fatal(err)
	}
	rfinal := waitOp(t, a.client, rop.ID)
	if rfinal.State != api.StateSucceeded || rfinal.Restore == nil || rfinal.Restore.Endpoint == nil {
		t.Fatalf("restore ended %+v", rfinal)
	}
	if rs := rfinal.Restore.VMState; rs.Image != final.Checkpoint.VMState.Image || rs.Checkpoint != index {
		t.Fatalf("restored %s through %s, want the state %s through the checkpoint %s", rs.Image, rs.Checkpoint, final.Checkpoint.VMState.Image, index)
	}
	if ep := rfinal.Restore.Endpoint; ep.PodUID != uid2 || ep.Container != "qemu" || ep.QMPPath != "/run/vm/qmp.sock" {
		t.Fatalf("endpoint %+v, want the new pod's", ep)
	}
	if target.Status() != "running" {
		t.Fatalf("target is %s", target.Status())
	}

	// The metrics count both.
	body := get(t, a, "/metrics")
	for _, want := range []string{`vmsnap_operations_total{kind="checkpoint",outcome="succeeded"} 1`, `vmsnap_operations_total{kind="restore",outcome="succeeded"} 1`,
		`vmsnap_operation_bytes_total{kind="checkpoint",what="raw"} 3.145728e+06`} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

func get(t *testing.T, a *testAgent, path string) string {
	t.Helper()
	resp, err := a.client.http.Get("http://agent" + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// "At once": the request itself is refused, before an operation exists
// that a caller would have to wait for.
func TestAgentRefusesUnknownVMAtOnce(t *testing.T) {
	a := startAgent(t, t.TempDir(), newStaticResolver(), 2)
	for _, uid := range []string{"", "6f1c2a4e-9999-4c0e-9a51-0123456789ab"} {
		op, err := a.client.Checkpoint(context.Background(), api.CheckpointRequest{
			VM: api.VMRef{PodUID: uid, Container: "qemu", QMPPath: "/q"}, Image: "oci:" + t.TempDir() + ":t",
		})
		if errcode.Of(err) != errcode.VMNotFound || op.ID != "" {
			t.Fatalf("uid %q: operation %q, err = %v; want the request refused, VM_NOT_FOUND", uid, op.ID, err)
		}
	}
	if ops, err := a.client.List(context.Background()); err != nil || len(ops) != 0 {
		t.Fatalf("operations %+v, %v; want none started for an unknown VM", ops, err)
	}
}

func TestAgentBusyForASecondOperation(t *testing.T) {
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20))
	res := newStaticResolver()
	res.add(uid1, vm.Path())
	// One slot, taken by a blocker: the first checkpoint stays pending, so
	// the second arrives while the VM has an active operation.
	a := startAgent(t, t.TempDir(), res, 1)
	a.srv.slots <- struct{}{}
	req := api.CheckpointRequest{VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/q"}, Image: "oci:" + t.TempDir() + ":t"}
	first, err := a.client.Checkpoint(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if first.State != api.StatePending {
		t.Fatalf("first is %s, want pending", first.State)
	}
	_, err = a.client.Checkpoint(context.Background(), req)
	if errcode.Of(err) != errcode.Busy {
		t.Fatalf("second checkpoint: %v, want BUSY", err)
	}
	<-a.srv.slots
	if o := waitOp(t, a.client, first.ID); o.State != api.StateSucceeded {
		t.Fatalf("first ended %s: %+v", o.State, o.Error)
	}
	// Now the VM is free again.
	second, err := a.client.Checkpoint(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	waitOp(t, a.client, second.ID)
}

func TestAgentForgetsDeletedVM(t *testing.T) {
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20))
	res := newStaticResolver()
	res.add(uid1, vm.Path())
	a := startAgent(t, t.TempDir(), res, 1)
	a.srv.slots <- struct{}{} // hold it pending
	op, err := a.client.Checkpoint(context.Background(), api.CheckpointRequest{
		VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/q"}, Image: "oci:" + t.TempDir() + ":t",
	})
	if err != nil {
		t.Fatal(err)
	}
	res.delete(uid1)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// The operation is cancelled and forgotten: asking for it says why, at once.
	for {
		_, err := a.client.Get(ctx, op.ID)
		if errcode.Of(err) == errcode.VMNotFound {
			if !strings.Contains(err.Error(), "deleted or replaced") {
				t.Fatalf("message %q does not say what happened", err)
			}
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("operation still known after its VM was deleted: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := a.client.Checkpoint(context.Background(), api.CheckpointRequest{
		VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/q"}, Image: "oci:" + t.TempDir() + ":t",
	}); errcode.Of(err) != errcode.VMNotFound {
		t.Fatalf("a new request for the deleted VM: %v, want VM_NOT_FOUND", err)
	}
	<-a.srv.slots
	if vm.Status() != "running" {
		t.Fatalf("VM is %s", vm.Status())
	}
}

// A journal entry left by a crash mid-checkpoint: the restarted agent
// finds the VM again through its resolver, continues it and reports the
// operation failed.
func TestAgentRecoveryContinuesStoppedVM(t *testing.T) {
	vm := stoppedFake(t)
	stateDir := t.TempDir()
	crashed := api.Operation{ID: "deadbeef00000001", Kind: api.KindCheckpoint, State: api.StateRunning,
		VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/vm/qmp.sock"}, Target: &api.Target{ContainerID: "c-" + uid1, QMPPath: vm.Path()}}
	succeeded := api.Operation{ID: "deadbeef00000002", Kind: api.KindCheckpoint, State: api.StateRunning,
		VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/vm/qmp.sock"}, Target: &api.Target{ContainerID: "c-" + uid1, QMPPath: vm.Path()}, Checkpoint: &api.CheckpointResult{Mode: "pause"}}
	writeJournal(t, stateDir, journalEntry{Op: crashed, VMWasRunning: true}, journalEntry{Op: succeeded})
	r := newStaticResolver()
	r.add(uid1, vm.Path())
	a := startAgent(t, stateDir, r, 1)
	if vm.Status() != "running" {
		t.Fatalf("VM is %s after recovery, want running", vm.Status())
	}
	o, err := a.client.Get(context.Background(), crashed.ID)
	if err != nil || o.State != api.StateFailed || !strings.Contains(o.Error.Message, "continued") {
		t.Fatalf("recovered op %+v, %v", o, err)
	}
	if o, _ := a.client.Get(context.Background(), succeeded.ID); o.State != api.StateSucceeded {
		t.Fatalf("an operation that had succeeded is %s after recovery", o.State)
	}
	if entries, _ := a.srv.journal.list(); len(entries) != 0 {
		t.Fatalf("journal still holds %d entries", len(entries))
	}
}

// The journal's host path is never dialed: recovery resolves the VM again
// and continues it only in the container the checkpoint stopped. A journal
// entry naming another VM's socket (a tampered or stale file) does not
// reach that VM; a container replaced since, or gone, is left alone.
func TestAgentRecoveryDoesNotDialJournaledPath(t *testing.T) {
	victim := stoppedFake(t) // another tenant's VM, paused on purpose
	own := stoppedFake(t)    // the pod's VM the checkpoint stopped
	replaced := stoppedFake(t)
	entry := func(id, uid, containerID string) journalEntry {
		return journalEntry{VMWasRunning: true, Op: api.Operation{ID: id, Kind: api.KindCheckpoint, State: api.StateRunning,
			VM:     api.VMRef{PodUID: uid, Container: "qemu", QMPPath: "/vm/qmp.sock"},
			Target: &api.Target{ContainerID: containerID, QMPPath: victim.Path()}}}
	}
	stateDir := t.TempDir()
	writeJournal(t, stateDir,
		entry("deadbeef00000001", uid1, "c-"+uid1),         // the pod's own VM, still there
		entry("deadbeef00000002", uid3, "c-old-container"), // a container replaced since
		entry("deadbeef00000003", uid4, "c-gone"))          // a pod gone
	r := newStaticResolver()
	r.add(uid1, own.Path())
	r.add(uid3, replaced.Path())
	a := startAgent(t, stateDir, r, 1)
	if own.Status() != "running" {
		t.Errorf("the pod's VM is %s after recovery, want running", own.Status())
	}
	if victim.Status() != "paused" || hasCommand(victim, "cont") {
		t.Errorf("the VM at the journal's host path was touched: %s, commands %v", victim.Status(), commandNames(victim))
	}
	if replaced.Status() != "paused" || hasCommand(replaced, "cont") {
		t.Errorf("the VM of a replaced container was continued: %s", replaced.Status())
	}
	for id, want := range map[string]string{"deadbeef00000002": "not the one the checkpoint stopped", "deadbeef00000003": "continuing the VM failed"} {
		o, err := a.client.Get(context.Background(), id)
		if err != nil || o.State != api.StateFailed || !strings.Contains(o.Error.Message, want) {
			t.Errorf("recovered op %s: %+v, %v; want failed, saying %q", id, o.Error, err, want)
		}
	}
}

// stoppedFake is a fake QEMU that was running and has been stopped.
func stoppedFake(t *testing.T) *qmptest.FakeQEMU {
	t.Helper()
	vm := qmptest.NewFakeQEMU(t, "running", nil)
	if err := vm.Dial(t).Execute(context.Background(), "stop", nil, nil); err != nil {
		t.Fatal(err)
	}
	return vm
}

func writeJournal(t *testing.T, stateDir string, entries ...journalEntry) {
	t.Helper()
	j, err := openJournal(stateDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if err := j.write(e); err != nil {
			t.Fatal(err)
		}
	}
}

func commandNames(vm *qmptest.FakeQEMU) []string {
	var names []string
	for _, c := range vm.Srv.Received() {
		names = append(names, c.Execute)
	}
	return names
}

func hasCommand(vm *qmptest.FakeQEMU, name string) bool {
	return slices.Contains(commandNames(vm), name)
}

func TestAgentRejectsBadRequests(t *testing.T) {
	a := startAgent(t, t.TempDir(), newStaticResolver(), 1)
	cases := map[string]string{
		"unknown field": `{"vm":{"podUID":"x","container":"c","qmp":"/q"},"image":"oci:/x:t","bogus":1}`,
		"not json":      `{"vm":`,
		"trailing":      `{"vm":{"podUID":"x","container":"c","qmp":"/q"},"image":"oci:/x:t"} {}`,
		"huge":          `{"image":"` + strings.Repeat("a", 100<<10) + `"}`,
	}
	for name, body := range cases {
		resp, err := a.client.http.Post("http://agent/v1/checkpoints", "application/json", bytes.NewBufferString(body))
		if err != nil {
			t.Fatal(err)
		}
		var doc api.ErrorDoc
		_ = json.NewDecoder(resp.Body).Decode(&doc)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest || doc.Error.Code != errcode.InvalidInput {
			t.Errorf("%s: %d %+v, want 400 INVALID_INPUT", name, resp.StatusCode, doc.Error)
		}
	}
}

func TestAgentSocketPermissions(t *testing.T) {
	a := startAgent(t, t.TempDir(), newStaticResolver(), 1)
	fi, err := os.Stat(a.socket)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o660 || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("socket mode %v, want 0660 socket", fi.Mode())
	}
	// A second agent on the same socket is refused.
	_, err = listen(a.socket, "")
	if errcode.Of(err) != errcode.Busy {
		t.Fatalf("second listen: %v, want BUSY", err)
	}
	if _, err := net.Dial("unix", a.socket); err != nil {
		t.Fatalf("the first agent stopped answering: %v", err)
	}
}

// A caller that stops waiting (its --timeout) gets the operation's own end,
// with its code: here the registry never answered, so REGISTRY_ERROR, with
// the caller's deadline still in the chain; and the VM was never stopped.
func TestWaitPastTheCallersDeadlineReportsTheOperationsEnd(t *testing.T) {
	stall := make(chan struct{})
	reg := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-stall:
		case <-r.Context().Done():
		}
	}))
	defer reg.Close()
	defer close(stall)
	host := strings.TrimPrefix(reg.URL, "http://")

	q := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20))
	res := newStaticResolver()
	res.add(uid1, q.Path())
	a := startAgentConfig(t, Config{StateDir: t.TempDir(), Resolver: res, MaxConcurrent: 1,
		Store: []ociimage.Option{ociimage.WithInsecureRegistry(host)}, AllowRepositories: []string{host + "/vm"}})
	defer a.stop()
	op, err := a.client.Checkpoint(context.Background(), api.CheckpointRequest{
		VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/run/vm/qmp.sock"}, Image: host + "/vm:snap", Mode: "snapshot",
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	o, err := a.client.Wait(ctx, op.ID, nil)
	if errcode.Of(err) != errcode.RegistryError || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Wait past the deadline: %v (code %s), want REGISTRY_ERROR wrapping the deadline", err, errcode.Of(err))
	}
	if !o.Done() || q.Status() != "running" || slices.Contains(q.Commands(), "stop") {
		t.Fatalf("operation %s, VM %s, commands %v: want it ended and the VM never stopped", o.State, q.Status(), q.Commands())
	}
}
