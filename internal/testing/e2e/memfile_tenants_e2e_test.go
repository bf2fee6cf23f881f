package e2e

// A memory-file restore through the agent, with real parts: the agent as
// its own process, real containerd, callers in containers of tenant-a and
// tenant-b, real QEMUs under TCG. Tenant A's QEMU names, as its RAM file,
// the file the agent prepared for tenant B; A's request names B's digest
// under A's own layout directory. A must get nothing of B's.

import (
	"encoding/json"
	"path/filepath"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

func TestAgentE2EMemoryFileRestoreReadsOnlyTheVMsNamespace(t *testing.T) {
	t.Parallel()
	ctrd := containerd.Start(t)
	guest.Assets(t)
	vmsnapBin := binary(t)
	dir := guest.FreeShortDir(t)
	shm := shmDir(t)
	overlay := guest.NewDisk(t, dir)
	const memMB = 256

	// Tenant B's VM, its RAM a shared file, checkpointed into B's layout
	// directory.
	src, before := bootGuest(t, guest.Options{Disk: overlay, Dir: dir, ExtraArgs: fileRAMArgs(filepath.Join(shm, "b.ram"), memMB)})
	layouts := t.TempDir()
	cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+layouts+"/tenant-b/vm:1", "--mode", "pause",
		"--disk", overlay, "--disk-image", "oci:"+layouts+"/tenant-b/disk:1")
	if cp.VMState.Format != "memory-file" {
		t.Fatalf("format %q, want memory-file", cp.VMState.Format)
	}
	resume := src.ResumeCounter()
	src.Kill()

	// The agent; B's image prepared in tenant-b's cache (an administrator
	// on the node asks, as B's own restore would have).
	sockDir := guest.FreeShortDir(t)
	sock := filepath.Join(sockDir, "agent.sock")
	startAgentProc(t, ctrd, t.TempDir(), sock, "--layout-root", layouts, "--admin-namespace", "platform")
	prepared := cliJSON[api.PrepareResult](t, "prepare", "--agent", "unix://"+sock, "--namespace", "tenant-b", cp.VMState.Image)

	// restore asks from a pod of ns for image into the VM of pod dst.
	restore := func(ns string, dst *podVM, image string) (uint32, []byte) {
		return inPod(t, ctrd, ns, sockDir, vmsnapBin, "restore", "--agent", "unix:///run/vmsnap/agent.sock",
			"--pod-uid", dst.uid, "--container", "qemu", "--qmp", dst.qmpInPod(), "--image", image, "--json")
	}
	// A pod of ns whose QEMU waits with -incoming defer, mapping the file
	// B's prepare made (its QEMU runs on the node: the path is the node's).
	target := func(ns, name string) *podVM {
		tdir := targetDir(t, dir)
		disk := restoreDisk(t, cp, tdir, name)
		return startPodVM(t, ctrd, guest.Options{Dir: tdir, Disk: disk, Incoming: true, ExtraArgs: prepared.QEMUArgs}, podOptions{namespace: ns})
	}

	a := target("tenant-a", "a.qcow2")
	code, out := restore("tenant-a", a, "oci:"+layouts+"/tenant-a/vm@"+cp.VMState.Digest)
	var doc api.ErrorDoc
	if err := json.Unmarshal(out, &doc); err != nil || code == 0 || doc.Error.Code != errcode.RegistryError {
		t.Errorf("tenant-a restoring tenant-b's digest from its own layout directory: exit %d, %s; want REGISTRY_ERROR (no such image there)", code, out)
	}
	if st := a.status(t); st != "inmigrate" {
		t.Fatalf("tenant-a's QEMU is %s: it was fed tenant-b's state", st)
	}

	// Tenant B's own restore of its image reads the state from the node,
	// and its guest resumes.
	b := target("tenant-b", "b.qcow2")
	code, out = restore("tenant-b", b, cp.VMState.Image)
	var rs api.RestoreResult
	if err := json.Unmarshal(out, &rs); err != nil || code != 0 || rs.VMState == nil || !rs.VMState.FromNode {
		t.Fatalf("tenant-b restoring its prepared image: exit %d, %s; want it loaded from the node", code, out)
	}
	assertResumed(t, b.vm, before, resume, resume)
}
