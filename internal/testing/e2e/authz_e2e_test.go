package e2e

// The agent's authorization with real parts: a real containerd and runc,
// containers labelled as the kubelet labels them, the agent as its own
// process, and callers that are `vmsnap` and a small client running inside
// containers of one pod namespace or another, on the agent's socket
// bind-mounted into them. The VM is a fake QEMU (qmp/qmptest) whose QMP
// socket is in tenant-a's volume: what matters here is whether a request
// reaches it at all.

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// testPrograms are the programs of testdata/ built so far, by name.
var testPrograms sync.Map // name -> *testProgram

type testProgram struct {
	once sync.Once
	path string
	err  error
}

// buildTestProgram builds testdata/NAME, static (to run in a container),
// once per test run, and returns its path.
func buildTestProgram(t *testing.T, name string) string {
	t.Helper()
	v, _ := testPrograms.LoadOrStore(name, &testProgram{})
	p := v.(*testProgram)
	p.once.Do(func() {
		dir, err := os.MkdirTemp("", "vmsnap-"+name+"-")
		if err != nil {
			p.err = err
			return
		}
		p.path = filepath.Join(dir, name)
		build := exec.Command("go", "build", "-o", p.path, "./testdata/"+name)
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			p.err = err
			t.Logf("go build: %s", out)
		}
	})
	if p.err != nil {
		t.Fatalf("building %s: %v", name, p.err)
	}
	return p.path
}

// agentcall is testdata/agentcall: one request to the agent from a container.
func agentcall(t *testing.T) string { return buildTestProgram(t, "agentcall") }

// inPod runs a program of the host (static) inside a new container of a
// pod in namespace ns, with the agent's socket directory mounted at
// /run/vmsnap, and returns its exit status and output.
func inPod(t *testing.T, ctrd *containerd.Daemon, ns, sockDir, program string, args ...string) (uint32, []byte) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := ctrd.Run(t, containerd.PodContainer{
		PodNamespace: ns, PodName: "caller", Name: "caller",
		Args: append([]string{"/caller"}, args...),
		Mounts: []specs.Mount{
			{Destination: "/caller", Type: "bind", Source: program, Options: []string{"rbind", "ro"}},
			{Destination: "/run/vmsnap", Type: "bind", Source: sockDir, Options: []string{"rbind", "rw"}},
		},
		Stdout: &stdout, Stderr: &stderr,
	}, time.Minute)
	t.Logf("in a pod of %s: %s %s -> exit %d\n%s%s", ns, filepath.Base(program), strings.Join(args, " "), code, stderr.Bytes(), stdout.Bytes())
	return code, stdout.Bytes()
}

func TestAgentE2ECallersActOnlyInTheirNamespace(t *testing.T) {
	t.Parallel()
	ctrd := containerd.Start(t)
	reg := registry.Start(t)
	vmsnapBin, callBin := binary(t), agentcall(t)

	// tenant-a's VM: a fake QEMU whose socket is in its pod's volume.
	vm := qmptest.NewFakeQEMU(t, "running", bytes.Repeat([]byte("tenant-a's memory "), 1<<14))
	uidA := containerd.NewPodUID()
	ctrd.Create(t, containerd.PodContainer{PodUID: uidA, PodNamespace: "tenant-a", Name: "qemu", HostDir: filepath.Dir(vm.Path())})
	qmpInPod := containerd.DefaultMountPath + "/" + filepath.Base(vm.Path())

	layouts := t.TempDir()
	sockDir := guest.FreeShortDir(t)
	sock := filepath.Join(sockDir, "agent.sock")
	startAgentProc(t, ctrd, t.TempDir(), sock, "--layout-root", layouts, "--admin-namespace", "platform",
		"--allow-repository", reg.Host+"/tenants/a", "--registry-config", reg.ConfigDir, "--ca-file", reg.CAFile)
	checkpointA := func(image string) []string {
		return []string{"checkpoint", "--agent", "unix:///run/vmsnap/agent.sock", "--pod-uid", uidA, "--container", "qemu",
			"--qmp", qmpInPod, "--image", image, "--mode", "snapshot", "--json"}
	}

	// tenant-b asks to checkpoint tenant-a's VM: FORBIDDEN (exit 12), and
	// the VM never hears of it.
	code, out := inPod(t, ctrd, "tenant-b", sockDir, vmsnapBin, checkpointA("oci:"+layouts+"/tenant-b/b:vm")...)
	var doc api.ErrorDoc
	if err := json.Unmarshal(out, &doc); err != nil || doc.Error.Code != errcode.Forbidden || code != 12 {
		t.Fatalf("tenant-b checkpointing tenant-a's VM: exit %d, %+v (%v); want FORBIDDEN, exit 12", code, doc.Error, err)
	}
	if cmds := vm.Commands(); len(cmds) != 0 {
		t.Fatalf("tenant-a's VM received %v from tenant-b's refused request", cmds)
	}
	if entries, _ := os.ReadDir(layouts); len(entries) != 0 {
		t.Fatalf("tenant-b's refused request wrote %v", entries)
	}

	// The same caller in tenant-a: the request reaches the VM and succeeds.
	code, out = inPod(t, ctrd, "tenant-a", sockDir, vmsnapBin, checkpointA("oci:"+layouts+"/tenant-a/a:vm")...)
	var cp api.CheckpointResult
	if err := json.Unmarshal(out, &cp); err != nil || code != 0 || !strings.Contains(cp.VMState.Image, "@sha256:") {
		t.Fatalf("tenant-a checkpointing its own VM: exit %d, %v: %s", code, err, out)
	}
	if n := len(vm.Commands()); n == 0 {
		t.Fatal("tenant-a's checkpoint succeeded without talking to the VM")
	}
	// A caller in an --admin-namespace acts on tenant-a's VM too, here
	// into an allowed repository.
	code, out = inPod(t, ctrd, "platform", sockDir, vmsnapBin, checkpointA(reg.Host+"/tenants/a/vm:1")...)
	if err := json.Unmarshal(out, &cp); err != nil || code != 0 || !strings.HasPrefix(cp.VMState.Image, reg.Host+"/tenants/a/vm@sha256:") {
		t.Fatalf("the platform's controller checkpointing tenant-a's VM: exit %d, %v: %s", code, err, out)
	}
	blobs := reg.BlobCount()

	// A process on the node is an admin: it sees every operation.
	c, err := agent.NewClient("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	ops, err := c.List(context.Background())
	if err != nil || len(ops) != 2 || ops[0].Target.Namespace != "tenant-a" {
		t.Fatalf("the host's list: %+v, %v; want both operations on tenant-a's VM", ops, err)
	}

	// Registry and layout targets outside the policy: FORBIDDEN before the
	// VM is touched, for an admin too, and nothing is written.
	outside := t.TempDir()
	commands := len(vm.Commands())
	for _, image := range []string{reg.Host + "/tenants/ab/vm:1", reg.Host + "/other/vm:1", "oci:" + outside + ":vm", "oci:" + layouts + "/../x:vm"} {
		_, err := c.Checkpoint(context.Background(), api.CheckpointRequest{
			VM: api.VMRef{PodUID: uidA, Container: "qemu", QMPPath: qmpInPod}, Image: image, Mode: "snapshot"})
		if errcode.Of(err) != errcode.Forbidden {
			t.Errorf("a checkpoint into %s: %v, want FORBIDDEN", image, err)
		}
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 0 {
		t.Errorf("a refused layout outside the root got %v", entries)
	}
	if reg.BlobCount() != blobs || len(reg.Tags(t, "tenants/ab/vm")) != 0 || len(reg.Tags(t, "other/vm")) != 0 {
		t.Error("a refused registry target got blobs or tags")
	}
	if len(vm.Commands()) != commands {
		t.Error("a refused target reached the VM")
	}

	// Listing, events and cancel from tenant-b see nothing of tenant-a.
	for _, path := range []string{"/v1/operations", "/v1/events"} {
		_, out := inPod(t, ctrd, "tenant-b", sockDir, callBin, "/run/vmsnap/agent.sock", "GET", path)
		if !strings.HasPrefix(string(out), "200\n") || strings.Contains(string(out), ops[0].ID) || strings.Contains(string(out), uidA) {
			t.Errorf("tenant-b's GET %s: %s", path, out)
		}
	}
	_, out = inPod(t, ctrd, "tenant-b", sockDir, callBin, "/run/vmsnap/agent.sock", "DELETE", "/v1/operations/"+ops[0].ID)
	if !strings.HasPrefix(string(out), "400\n") || !strings.Contains(string(out), "no operation "+ops[0].ID) {
		t.Errorf("tenant-b cancelling tenant-a's operation: %s, want what an unknown operation gets", out)
	}
	_, out = inPod(t, ctrd, "tenant-a", sockDir, callBin, "/run/vmsnap/agent.sock", "GET", "/v1/operations")
	if !strings.Contains(string(out), ops[0].ID) || !strings.Contains(string(out), ops[1].ID) {
		t.Errorf("tenant-a's list lacks the operations on its VM: %s", out)
	}

	// A process in a pid namespace of its own, in no container: the agent
	// cannot tell which pod it is, so it refuses it.
	if unshare, err := exec.LookPath("unshare"); err == nil {
		out, err := exec.Command(unshare, "--pid", "--fork", callBin, sock, "GET", "/v1/operations").Output()
		if err != nil || !strings.HasPrefix(string(out), "403\n") || !strings.Contains(string(out), `"FORBIDDEN"`) || strings.Contains(string(out), ops[0].ID) {
			t.Errorf("a caller in another pid namespace and no container: %s (%v), want FORBIDDEN", out, err)
		}
	} else {
		t.Errorf("unshare (util-linux) is needed to test a caller in a pid namespace of its own: %v", err)
	}
}
