package e2e

// Per-tenant images with real parts: the agent as its own process with
// --allow-repository REG/vms/{namespace} and a layout root, callers in
// containers of tenant-a and tenant-b (real containerd and runc, labelled
// as the kubelet labels them), a real registry with TLS and htpasswd. Each
// tenant's VM is a fake QEMU in its pod's volume.

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

func TestAgentE2ECallersUseOnlyTheirNamespacesImages(t *testing.T) {
	t.Parallel()
	ctrd := containerd.Start(t)
	reg := registry.Start(t)
	vmsnapBin := binary(t)

	type tenant struct {
		ns, uid, qmp string
		vm           *qmptest.FakeQEMU
	}
	newTenant := func(ns string) *tenant {
		vm := qmptest.NewFakeQEMU(t, "running", bytes.Repeat([]byte(ns+"'s memory "), 1<<14))
		tn := &tenant{ns: ns, uid: containerd.NewPodUID(), vm: vm,
			qmp: containerd.DefaultMountPath + "/" + filepath.Base(vm.Path())}
		ctrd.Create(t, containerd.PodContainer{PodUID: tn.uid, PodNamespace: ns, Name: "qemu", HostDir: filepath.Dir(vm.Path())})
		return tn
	}
	a, b := newTenant("tenant-a"), newTenant("tenant-b")

	layouts := t.TempDir()
	sockDir := guest.FreeShortDir(t)
	startAgentProc(t, ctrd, t.TempDir(), filepath.Join(sockDir, "agent.sock"), "--layout-root", layouts, "--admin-namespace", "platform",
		"--allow-repository", reg.Host+"/vms/{namespace}", "--registry-config", reg.ConfigDir, "--ca-file", reg.CAFile)
	agentArgs := func(tn *tenant, verb string) []string {
		return []string{verb, "--agent", "unix:///run/vmsnap/agent.sock", "--pod-uid", tn.uid, "--container", "qemu", "--qmp", tn.qmp, "--json"}
	}
	// checkpoint runs `vmsnap checkpoint` in a pod of ns on tn's VM.
	checkpoint := func(ns string, tn *tenant, image string, extra ...string) (uint32, []byte) {
		return inPod(t, ctrd, ns, sockDir, vmsnapBin, append(agentArgs(tn, "checkpoint"), append([]string{"--image", image, "--mode", "snapshot"}, extra...)...)...)
	}
	// ran is a caller's exit status and output.
	type ran struct {
		code uint32
		out  []byte
	}
	r := func(code uint32, out []byte) ran { return ran{code, out} }
	succeeded := func(what string, x ran) api.CheckpointResult {
		t.Helper()
		code, out := x.code, x.out
		var cp api.CheckpointResult
		if err := json.Unmarshal(out, &cp); err != nil || code != 0 || !strings.Contains(cp.VMState.Image, "@sha256:") {
			t.Fatalf("%s: exit %d, %v: %s", what, code, err, out)
		}
		return cp
	}
	forbidden := func(what string, x ran) {
		t.Helper()
		code, out := x.code, x.out
		var doc api.ErrorDoc
		if err := json.Unmarshal(out, &doc); err != nil || doc.Error.Code != errcode.Forbidden || code != 12 {
			t.Errorf("%s: exit %d, %+v (%v); want FORBIDDEN, exit 12", what, code, doc.Error, err)
		}
	}

	// Each tenant in its own repository and layout directory.
	cpA := succeeded("tenant-a into its repository", r(checkpoint("tenant-a", a, reg.Host+"/vms/tenant-a/vm:1")))
	layoutA := succeeded("tenant-a into its layout", r(checkpoint("tenant-a", a, "oci:"+layouts+"/tenant-a/vm:1")))
	succeeded("tenant-b into its repository", r(checkpoint("tenant-b", b, reg.Host+"/vms/tenant-b/vm:1")))
	succeeded("tenant-b into its layout", r(checkpoint("tenant-b", b, "oci:"+layouts+"/tenant-b/vm:1")))
	tagsA := reg.Tags(t, "vms/tenant-a/vm")
	blobs := reg.BlobCount()
	layoutFiles := func() []string {
		var files []string
		_ = filepath.WalkDir(filepath.Join(layouts, "tenant-a"), func(p string, _ os.DirEntry, _ error) error {
			files = append(files, p)
			return nil
		})
		return files
	}
	beforeA := layoutFiles()
	commandsB := len(b.vm.Commands())

	// tenant-b, on its own VM, into tenant-a's repository and layout:
	// over its tag, and with keep, which would prune tenant-a's repository.
	forbidden("tenant-b pushing over tenant-a's tag", r(checkpoint("tenant-b", b, reg.Host+"/vms/tenant-a/vm:1")))
	forbidden("tenant-b pushing into tenant-a's repository with keep", r(checkpoint("tenant-b", b, reg.Host+"/vms/tenant-a/other:1", "--keep", "1")))
	forbidden("tenant-b writing into tenant-a's layout", r(checkpoint("tenant-b", b, "oci:"+layouts+"/tenant-a/vm:2")))
	forbidden("tenant-b writing at the layout root", r(checkpoint("tenant-b", b, "oci:"+layouts+"/shared:1")))
	// ... and restoring tenant-a's snapshots into its own VM.
	for _, image := range []string{cpA.VMState.Image, layoutA.VMState.Image} {
		forbidden("tenant-b restoring "+image, r(inPod(t, ctrd, "tenant-b", sockDir, vmsnapBin, append(agentArgs(b, "restore"), "--image", image)...)))
	}
	if got := reg.Tags(t, "vms/tenant-a/vm"); !slices.Equal(got, tagsA) || reg.BlobCount() != blobs || len(reg.Tags(t, "vms/tenant-a/other")) != 0 {
		t.Errorf("tenant-a's repositories changed: tags %v (were %v), %d blobs (were %d)", got, tagsA, reg.BlobCount(), blobs)
	}
	if after := layoutFiles(); !slices.Equal(after, beforeA) {
		t.Errorf("tenant-a's layout changed: %v, was %v", after, beforeA)
	}
	if _, err := os.Stat(filepath.Join(layouts, "shared")); !os.IsNotExist(err) {
		t.Errorf("a refused layout at the root was made: %v", err)
	}
	if n := len(b.vm.Commands()); n != commandsB {
		t.Errorf("refused requests reached tenant-b's VM (%d commands, were %d)", n, commandsB)
	}

	// A caller in an --admin-namespace uses any tenant's repository.
	succeeded("the platform into tenant-a's repository", r(checkpoint("platform", a, reg.Host+"/vms/tenant-a/vm:2")))
}
