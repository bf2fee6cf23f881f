package main

// The node agent end to end: a real containerd running a container labelled
// like a kubelet's, whose volume holds the QMP socket of a real QEMU guest;
// the agent as its own process (so it can be killed); the Job client.

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testcontainerd"
	"github.com/vmsnap/vmsnap/internal/testguest"
)

var vmsnapBinary struct {
	once sync.Once
	path string
	err  error
}

// binary builds vmsnap once per test run.
func binary(t *testing.T) string {
	t.Helper()
	vmsnapBinary.once.Do(func() {
		dir, err := os.MkdirTemp("", "vmsnap-bin-")
		if err != nil {
			vmsnapBinary.err = err
			return
		}
		vmsnapBinary.path = filepath.Join(dir, "vmsnap")
		out, err := exec.Command("go", "build", "-o", vmsnapBinary.path, ".").CombinedOutput()
		if err != nil {
			vmsnapBinary.err = &exec.ExitError{}
			t.Logf("go build: %s", out)
		}
	})
	if vmsnapBinary.err != nil {
		t.Fatalf("building vmsnap: %v", vmsnapBinary.err)
	}
	return vmsnapBinary.path
}

// agentProc is `vmsnap agent` running as its own process.
type agentProc struct {
	cmd      *exec.Cmd
	socket   string
	stateDir string
	log      *os.File
	done     chan struct{}
}

func startAgentProc(t *testing.T, ctrd *testcontainerd.Daemon, stateDir, socket string) *agentProc {
	t.Helper()
	log, err := os.CreateTemp(t.TempDir(), "agent-*.log")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(binary(t), "agent", "--socket", socket, "--state-dir", stateDir,
		"--containerd-address", ctrd.Address, "--containerd-namespace", testcontainerd.Namespace, "--log-level", "debug")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &agentProc{cmd: cmd, socket: socket, stateDir: stateDir, log: log, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		p.kill()
		if t.Failed() {
			b, _ := os.ReadFile(log.Name())
			t.Logf("agent log:\n%s", b)
		}
	})
	c, err := agent.NewClient("unix://" + socket)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for c.Health(context.Background()) != nil {
		select {
		case <-p.done:
			b, _ := os.ReadFile(log.Name())
			t.Fatalf("the agent exited at start:\n%s", b)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the agent did not answer within 15s")
		}
		time.Sleep(50 * time.Millisecond)
	}
	return p
}

func (p *agentProc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// podVM is a test guest whose directory is a volume of a container of a
// pod: what the agent finds through containerd.
type podVM struct {
	vm        *testguest.VM
	uid       string
	container *testcontainerd.Container
	dir       string
	monitor   string // a second QMP socket for the test's own eyes
}

// qmpInPod is the guest's QMP socket as the container sees it.
func (p *podVM) qmpInPod() string {
	return testcontainerd.DefaultMountPath + "/" + filepath.Base(p.vm.QMPPath())
}

func (p *podVM) status(t *testing.T) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	raw, err := testguest.QMP(ctx, p.monitor, "query-status", nil)
	if err != nil {
		t.Fatalf("query-status on the test's monitor: %v", err)
	}
	var st struct{ Status string }
	_ = json.Unmarshal(raw, &st)
	return st.Status
}

func startPodVM(t *testing.T, ctrd *testcontainerd.Daemon, opts testguest.Options) *podVM {
	t.Helper()
	if opts.Dir == "" {
		opts.Dir = testguest.FreeShortDir(t)
	}
	monitor := filepath.Join(opts.Dir, "test-mon.sock")
	opts.ExtraArgs = append(opts.ExtraArgs, "-qmp", "unix:"+monitor+",server=on,wait=off")
	vm := testguest.Start(t, opts)
	uid := testcontainerd.NewPodUID()
	c := ctrd.Create(t, testcontainerd.PodContainer{PodUID: uid, Name: "qemu", HostDir: opts.Dir})
	return &podVM{vm: vm, uid: uid, container: c, dir: opts.Dir, monitor: monitor}
}

func TestAgentE2EJobCheckpointAndAgentRestore(t *testing.T) {
	ctrd := testcontainerd.Start(t)
	testguest.Assets(t)
	dir := testguest.FreeShortDir(t)
	src := startPodVM(t, ctrd, testguest.Options{Dir: dir, Disk: testguest.NewDisk(t, dir)})
	before, err := src.vm.WaitStatus(waitCtx(t), func(s testguest.Status) bool { return s.Counter >= 1 })
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(testguest.FreeShortDir(t), "agent.sock")
	startAgentProc(t, ctrd, t.TempDir(), sock)
	store := filepath.Join(t.TempDir(), "store")
	termLog := filepath.Join(t.TempDir(), "termination-log")

	// The Job's command line: paths as the QEMU container sees them.
	cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--agent", "unix://"+sock, "--pod-uid", src.uid, "--container", "qemu",
		"--qmp", src.qmpInPod(), "--disk", testcontainerd.DefaultMountPath+"/overlay.qcow2",
		"--image", "oci:"+store+":vm", "--disk-image", "oci:"+store+":vm-disk", "--mode", "pause", "--termination-log", termLog)
	if cp.VMRunning || src.status(t) == "running" || cp.Disk == nil || !strings.Contains(cp.VMState.Image, "@sha256:") {
		t.Fatalf("checkpoint through the agent: %+v (VM %s)", cp, src.status(t))
	}
	var logged api.CheckpointResult
	if b, err := os.ReadFile(termLog); err != nil || json.Unmarshal(b, &logged) != nil || logged.VMState.Digest != cp.VMState.Digest {
		t.Fatalf("termination log does not hold the result: %v", err)
	}
	resume := src.vm.ResumeCounter()
	src.vm.Kill()

	// The restored pod: its init container put the overlay in place, its
	// QEMU waits with -incoming defer, and the agent loads the state.
	tdir := targetDir(t, dir)
	cliJSON[api.RestoreResult](t, "restore", "--disk-image", cp.Disk.Image, "--disk", filepath.Join(tdir, "overlay.qcow2"))
	dst := startPodVM(t, ctrd, testguest.Options{Dir: tdir, Disk: filepath.Join(tdir, "overlay.qcow2"), Incoming: true})
	rs := cliJSON[api.RestoreResult](t, "restore", "--agent", "unix://"+sock, "--pod-uid", dst.uid, "--container", "qemu",
		"--qmp", dst.qmpInPod(), "--image", cp.VMState.Image)
	if rs.Endpoint == nil || rs.Endpoint.PodUID != dst.uid || rs.Endpoint.QMPPath != dst.qmpInPod() {
		t.Fatalf("the restore result does not carry the new endpoint: %+v", rs.Endpoint)
	}
	assertResumed(t, dst.vm, before, resume, resume)

	// A wrong pod UID is VM_NOT_FOUND, at once.
	start := time.Now()
	cliError(t, errcode.VMNotFound, "checkpoint", "--agent", "unix://"+sock, "--pod-uid", testcontainerd.NewPodUID(), "--container", "qemu",
		"--qmp", "/run/vm/vm1.qmp", "--image", "oci:"+store+":x")
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("a wrong pod UID took %v to refuse", d)
	}
}

// A guest big enough that its checkpoint takes a moment under TCG.
func bigGuest(dir string) testguest.Options {
	return testguest.Options{Dir: dir, MemMB: 512, GuestMemMB: 160}
}

func TestAgentE2EBusyAndDeletedContainer(t *testing.T) {
	ctrd := testcontainerd.Start(t)
	testguest.Assets(t)
	src := startPodVM(t, ctrd, bigGuest(testguest.FreeShortDir(t)))
	if _, err := src.vm.WaitStatus(waitCtx(t), func(s testguest.Status) bool { return s.Counter >= 1 }); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(testguest.FreeShortDir(t), "agent.sock")
	startAgentProc(t, ctrd, t.TempDir(), sock)
	c, _ := agent.NewClient("unix://" + sock)
	ctx := context.Background()
	req := api.CheckpointRequest{VM: api.VMRef{PodUID: src.uid, Container: "qemu", QMPPath: src.qmpInPod()},
		Image: "oci:" + filepath.Join(t.TempDir(), "store") + ":vm", Mode: "snapshot", Workers: 1}
	op, err := c.Checkpoint(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Checkpoint(ctx, req); errcode.Of(err) != errcode.Busy {
		t.Fatalf("a second checkpoint of the same VM: %v, want BUSY", err)
	}
	// Delete the container once the state is streaming.
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var deleted sync.Once
	final, err := c.Wait(wctx, op.ID, func(o api.Operation) {
		if o.Progress != nil && o.Progress.Bytes > 0 {
			deleted.Do(func() { ctrd.Delete(t, src.container) })
		}
	})
	if errcode.Of(err) != errcode.VMNotFound && final.State != api.StateCancelled {
		t.Fatalf("operation after its container was deleted: %+v, %v", final, err)
	}
	// Every record of it is gone: asking gets VM_NOT_FOUND at once.
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err := c.Get(ctx, op.ID)
		if errcode.Of(err) == errcode.VMNotFound {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the operation is still known: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := c.Checkpoint(ctx, req); errcode.Of(err) != errcode.VMNotFound {
		t.Fatalf("a new checkpoint of the deleted pod: %v, want VM_NOT_FOUND", err)
	}
	// The VM itself was put back: the cancelled snapshot continued it.
	waitRunning(t, src)
}

func waitRunning(t *testing.T, p *podVM) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for p.status(t) != "running" {
		if time.Now().After(deadline) {
			t.Fatalf("the VM is %s, want running", p.status(t))
		}
		time.Sleep(100 * time.Millisecond)
	}
	last, _ := p.vm.LastStatus()
	if _, err := p.vm.WaitStatus(waitCtx(t), func(s testguest.Status) bool { return s.Counter > last.Counter }); err != nil {
		t.Fatalf("the guest does not count on: %v", err)
	}
}

func TestAgentE2EKilledAgentContinuesVMOnRestart(t *testing.T) {
	ctrd := testcontainerd.Start(t)
	testguest.Assets(t)
	src := startPodVM(t, ctrd, bigGuest(testguest.FreeShortDir(t)))
	if _, err := src.vm.WaitStatus(waitCtx(t), func(s testguest.Status) bool { return s.Counter >= 1 }); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(testguest.FreeShortDir(t), "agent.sock")
	stateDir := t.TempDir()
	p := startAgentProc(t, ctrd, stateDir, sock)
	c, _ := agent.NewClient("unix://" + sock)
	op, err := c.Checkpoint(context.Background(), api.CheckpointRequest{
		VM:    api.VMRef{PodUID: src.uid, Container: "qemu", QMPPath: src.qmpInPod()},
		Image: "oci:" + filepath.Join(t.TempDir(), "store") + ":vm", Mode: "snapshot", Workers: 1,
	})
	if err != nil {
		t.Fatal(err)
	}
	// Kill -9 the agent while the VM is stopped.
	deadline := time.Now().Add(30 * time.Second)
	for st := src.status(t); st == "running"; st = src.status(t) {
		if time.Now().After(deadline) {
			t.Fatal("the VM was never stopped")
		}
		time.Sleep(5 * time.Millisecond)
	}
	p.kill()
	time.Sleep(300 * time.Millisecond)
	if st := src.status(t); st == "running" {
		t.Fatalf("the VM runs after the agent died mid-checkpoint (%s): the kill came too late to test anything", st)
	}
	// The restarted agent finds the journal and continues the VM.
	startAgentProc(t, ctrd, stateDir, sock)
	waitRunning(t, src)
	o, err := c.Get(context.Background(), op.ID)
	if err != nil || o.State != api.StateFailed || !strings.Contains(o.Error.Message, "continued") {
		t.Fatalf("the interrupted operation after restart: %+v, %v", o, err)
	}
}
