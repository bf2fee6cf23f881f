package agent

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/hook"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// panickyResolver panics in Resolve, which a request's handler calls.
type panickyResolver struct{ *staticResolver }

func (panickyResolver) Resolve(context.Context, VMRef) (*Resolved, error) {
	var m map[string]bool
	//lint:ignore SA5000 the write to a nil map is the panic under test
	m["x"] = true
	return nil, nil
}

// A handler that panics answers INTERNAL with the message and no stack;
// the stack is in the agent's log at level debug, and the agent serves on.
func TestAgentHandlerPanicIsInternal(t *testing.T) {
	var log syncBuffer
	a := startAgentConfig(t, Config{StateDir: t.TempDir(), Resolver: panickyResolver{newStaticResolver()},
		Logger: slog.New(slog.NewJSONHandler(&log, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	_, err := a.client.Checkpoint(context.Background(), api.CheckpointRequest{
		VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/run/vm/qmp.sock"}, Image: "oci:" + t.TempDir() + ":vm"})
	if errcode.Of(err) != errcode.Internal || !strings.Contains(err.Error(), "assignment to entry in nil map") ||
		!strings.Contains(err.Error(), "this is a bug in vmsnap") || strings.Contains(err.Error(), "goroutine") {
		t.Fatalf("a panicking handler answered %v (%s)", err, errcode.Of(err))
	}
	if err := a.client.Health(context.Background()); err != nil {
		t.Fatalf("the agent does not answer after a handler panicked: %v", err)
	}
	if ops, err := a.client.List(context.Background()); err != nil || len(ops) != 0 {
		t.Fatalf("the agent's API after a handler panicked: %v, %v", ops, err)
	}
	logged := log.String()
	if !strings.Contains(logged, `"level":"ERROR","msg":"recovered from a bug in a request's handler"`) ||
		!strings.Contains(logged, `"level":"DEBUG","msg":"stack of the bug in a request's handler"`) || !strings.Contains(logged, "goroutine ") {
		t.Fatalf("the agent's log lacks the bug or its stack:\n%s", logged)
	}
}

// A checkpoint that panics while its VM is stopped fails as INTERNAL: the
// VM runs again, no tag names the partial snapshot, the journal is clean
// and the VM is free for the next operation.
func TestAgentCheckpointPanicContinuesVM(t *testing.T) {
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20))
	res := newStaticResolver()
	res.vms[uid1] = api.Target{PodUID: uid1, Container: "qemu", ContainerID: "c-" + uid1, QMPPath: vm.Path(), DiskPath: guest.NewDisk(t, t.TempDir())}
	a := startAgent(t, t.TempDir(), res, 1)
	store := t.TempDir()
	req := api.CheckpointRequest{VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/run/vm/qmp.sock", DiskPath: "/run/vm/overlay.qcow2"},
		Image: "oci:" + store + ":vm", DiskImage: "oci:" + store + ":vm-disk", Mode: "pause"}

	restore := hook.Swap(&hook.BeforeDiskCapture, func() { panic("a bug while the VM is stopped") })
	t.Cleanup(restore)
	final := checkpointAndWait(t, a, req)
	if final.State != api.StateFailed || final.Error == nil || final.Error.Code != errcode.Internal ||
		!strings.Contains(final.Error.Message, "a bug while the VM is stopped") || !strings.Contains(final.Error.Message, "the VM was continued") {
		t.Fatalf("the checkpoint that panicked ended %+v %+v", final, final.Error)
	}
	if vm.Status() != "running" {
		t.Fatalf("the VM is %s after a checkpoint that panicked", vm.Status())
	}
	assertNoTag(t, store, "vm", "vm-disk")
	if entries, _ := a.srv.journal.list(); len(entries) != 0 {
		t.Fatalf("the journal holds %d entries", len(entries))
	}
	restore()
	if again := checkpointAndWait(t, a, req); again.State != api.StateSucceeded {
		t.Fatalf("the next checkpoint of the VM ended %s: %+v", again.State, again.Error)
	}
}

// A panic in an operation outside vmstate's guard, with the VM stopped
// (as the journal says), is put back as after a crash of the agent: the VM
// is continued through the resolver.
func TestAgentOperationPanicPutsTheVMBack(t *testing.T) {
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20))
	res := newStaticResolver()
	res.add(uid1, vm.Path())
	a := startAgent(t, t.TempDir(), res, 1)
	SetAfterResolve(t, func() {
		ops := a.srv.ops.list(func(api.Operation) bool { return true })
		if err := a.srv.journal.write(journalEntry{Op: ops[len(ops)-1], VMWasRunning: true}); err != nil {
			t.Error(err)
		}
		if err := vm.Dial(t).Execute(context.Background(), "stop", nil, nil); err != nil {
			t.Error(err)
		}
		var p *api.Operation
		_ = p.ID // nil pointer: a bug after the VM was stopped
	})
	final := checkpointAndWait(t, a, api.CheckpointRequest{VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/run/vm/qmp.sock"},
		Image: "oci:" + t.TempDir() + ":vm", Mode: "pause"})
	if final.State != api.StateFailed || final.Error == nil || final.Error.Code != errcode.Internal ||
		!strings.Contains(final.Error.Message, "nil pointer dereference") || !strings.Contains(final.Error.Message, "the VM was continued") {
		t.Fatalf("the operation that panicked ended %+v %+v", final, final.Error)
	}
	if vm.Status() != "running" {
		t.Fatalf("the VM is %s after an operation that panicked", vm.Status())
	}
}

func checkpointAndWait(t *testing.T, a *testAgent, req api.CheckpointRequest) api.Operation {
	t.Helper()
	op, err := a.client.Checkpoint(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	return waitOp(t, a.client, op.ID)
}

// assertNoTag fails if the layout in dir holds any of tags.
func assertNoTag(t *testing.T, dir string, tags ...string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "index.json"))
	if os.IsNotExist(err) {
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, tag := range tags {
		if bytes.Contains(b, []byte(`"org.opencontainers.image.ref.name":"`+tag+`"`)) {
			t.Fatalf("the tag %s names a snapshot of a failed checkpoint: %s", tag, b)
		}
	}
}
