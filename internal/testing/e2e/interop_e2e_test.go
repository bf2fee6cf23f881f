package e2e

// Interoperability: every kind of vmsnap checkpoint, copied from one
// registry to another by crane copy, oras cp -r and skopeo copy --all,
// restores from the copy alone, with the first registry stopped and only
// the second's credentials: the guest comes back exact. One guest per kind,
// checkpointed once; three copies and three restores from it.

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

// restoreCopy restores the checkpoint index names (on the second registry,
// reached with args) into a new target beside the source's base image: the
// disk overlay, then the state, both through the index.
func restoreCopy(t *testing.T, srcDir, index string, args []string) *guest.VM {
	t.Helper()
	tdir := targetDir(t, srcDir)
	disk := filepath.Join(tdir, "overlay.qcow2")
	rd := cliJSON[api.RestoreResult](t, with([]string{"restore", "--disk-image", index, "--disk", disk}, args...)...)
	if rd.Disk == nil || rd.Disk.Checkpoint != index {
		t.Fatalf("the disk restore from %s: %+v", index, rd.Disk)
	}
	target := startTarget(t, tdir, disk, 0)
	rs := cliJSON[api.RestoreResult](t, with([]string{"restore", "--qmp", target.QMPPath(), "--image", index}, args...)...)
	if rs.VMState == nil || rs.VMState.Checkpoint != index || !rs.VMState.VMRunning {
		t.Fatalf("the state restore from %s: %+v", index, rs.VMState)
	}
	return target
}

// TestInteropStreamAndEncrypted: a guest's checkpoint (snapshot mode, its
// disk image in the same repository), then an encrypted one (pause mode),
// each copied by every tool; each copy restores the guest exactly (the
// same boot, memory and disk; the counter where the checkpoint took it),
// the encrypted one with its key.
func TestInteropStreamAndEncrypted(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	p := startPair(t)
	tools := copyTools(t)
	priv, pub, _ := e2eKey(t, t.TempDir(), "tenant", false)
	dir := guest.FreeShortDir(t)
	src, before := bootSource(t, dir)
	checkpoint := func(tag, mode string, extra ...string) api.CheckpointResult {
		t.Helper()
		return cliJSON[api.CheckpointResult](t, with(append([]string{"checkpoint", "--qmp", src.QMPPath(), "--mode", mode,
			"--image", p.src.Host + "/vms/stream:" + tag, "--disk", filepath.Join(dir, "overlay.qcow2"),
			"--disk-image", p.src.Host + "/vms/stream:" + tag + "-disk"}, extra...), regArgs(p.src)...)...)
	}
	// The snapshot resumes somewhere between the lines printed before and
	// after it; the pause, exactly at the next.
	first, _ := src.LastStatus()
	plain := checkpoint("plain", "snapshot")
	if _, err := src.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > first.Counter+1 }); err != nil {
		t.Fatal(err)
	}
	after, _ := src.LastStatus()
	enc := checkpoint("enc", "pause", "--encrypt-recipient", "jwe:"+pub)
	resume := src.ResumeCounter()
	src.Kill()

	copies := p.copyEverywhere(t, tools, "vms/stream", "plain", "enc")
	p.src.Stop()
	for _, tool := range tools {
		for _, c := range []struct {
			cp       api.CheckpointResult
			extra    []string
			min, max int
		}{{plain, nil, first.Counter + 1, after.Counter + 1}, {enc, []string{"--decryption-key", priv}, resume, resume}} {
			index := copies[tool.name] + "@" + c.cp.Checkpoint.Digest
			t.Logf("%s's copy: %s", tool.name, index)
			target := restoreCopy(t, dir, index, append(regArgs(p.dst), c.extra...))
			assertResumed(t, target, before, c.min, c.max)
			target.Kill()
		}
	}
}

// TestInteropMemoryFileChain: a memory-file base and a delta on it (pause
// mode, with the disk), the delta's checkpoint copied by every tool: its
// manifest lists the base's region layers, so each copy alone prepares the
// RAM file (fetched from the copy into a cache of its own) and the guest
// resumes exactly on it.
func TestInteropMemoryFileChain(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	p := startPair(t)
	tools := copyTools(t)
	dir := guest.FreeShortDir(t)
	shm := shmDir(t)
	overlay := guest.NewDisk(t, dir)
	const memMB = 256
	src, before := bootGuest(t, guest.Options{Disk: overlay, Dir: dir, ExtraArgs: fileRAMArgs(filepath.Join(shm, "src.ram"), memMB)})
	image := p.src.Host + "/vms/mem:vm"
	base := cliJSON[api.CheckpointResult](t, with([]string{"checkpoint", "--qmp", src.QMPPath(), "--image", image, "--mode", "snapshot"}, regArgs(p.src)...)...)
	if _, err := src.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > before.Counter+1 }); err != nil {
		t.Fatal(err)
	}
	delta := cliJSON[api.CheckpointResult](t, with([]string{"checkpoint", "--qmp", src.QMPPath(), "--image", image, "--mode", "pause",
		"--disk", overlay, "--disk-image", p.src.Host + "/vms/mem:vm-disk"}, regArgs(p.src)...)...)
	if r := delta.VMState.RAM; r == nil || len(r.Chain) != 2 || r.Parent != base.VMState.Digest {
		t.Fatalf("the second checkpoint is not a delta on the first: %+v", delta.VMState.RAM)
	}
	resume := src.ResumeCounter()
	src.Kill()

	copies := p.copyEverywhere(t, tools, "vms/mem", "vm")
	p.src.Stop()
	for _, tool := range tools {
		index := copies[tool.name] + "@" + delta.Checkpoint.Digest
		pr := cliJSON[api.PrepareResult](t, with([]string{"prepare", index, "--cache-dir", filepath.Join(shm, "cache-"+tool.name)}, regArgs(p.dst)...)...)
		if pr.FetchedBytes == 0 || pr.Checkpoint != index || pr.Digest != delta.VMState.Digest {
			t.Fatalf("prepare of %s's copy: %+v", tool.name, pr)
		}
		tdir := targetDir(t, dir)
		disk := filepath.Join(tdir, "overlay.qcow2")
		cliJSON[api.RestoreResult](t, with([]string{"restore", "--disk-image", index, "--disk", disk}, regArgs(p.dst)...)...)
		target := guest.Start(t, guest.Options{Dir: tdir, Incoming: true, Disk: disk, ExtraArgs: pr.QEMUArgs})
		cliJSON[api.RestoreResult](t, with([]string{"restore", "--qmp", target.QMPPath(), "--image", index}, regArgs(p.dst)...)...)
		assertResumed(t, target, before, resume, resume)
		target.Kill()
	}
}

// TestInteropRootfsThroughTheAgent: a VM in a container whose disk overlay
// is in the container's writable layer, checkpointed through the agent with
// its rootfs image in the checkpoint's repository, copied by every tool.
// From each copy: the rootfs image is pulled (by skopeo, as a node's
// runtime would) and a container started from it, its QEMU waiting on the
// overlay the image holds, and the agent loads the state through the
// copy's checkpoint digest: the guest resumes exactly.
func TestInteropRootfsThroughTheAgent(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	p := startPair(t)
	tools := copyTools(t)
	ctrd := containerd.Start(t)
	const inPod = "/vm/disk/overlay.qcow2"
	srcPod := startPodVM(t, ctrd, guest.Options{}, podOptions{layerDisk: inPod})
	before, err := srcPod.vm.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter >= 1 })
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(guest.FreeShortDir(t), "agent.sock")
	allow := []string{"--registry-config", p.both, "--ca-file", p.cas, "--allow-repository", p.src.Host + "/vms"}
	for _, tool := range tools {
		allow = append(allow, "--allow-repository", p.dst.Host+"/"+tool.name)
	}
	startAgentProc(t, ctrd, t.TempDir(), sock, allow...)
	agentArgs := func(pod *podVM) []string {
		return []string{"--agent", "unix://" + sock, "--pod-uid", pod.uid, "--container", "qemu", "--qmp", pod.qmpInPod()}
	}
	cp := cliJSON[api.CheckpointResult](t, append([]string{"checkpoint", "--disk", inPod, "--mode", "pause",
		"--image", p.src.Host + "/vms/pod:vm", "--rootfs-image", p.src.Host + "/vms/pod:vm-rootfs"}, agentArgs(srcPod)...)...)
	if cp.Rootfs == nil || cp.Disk == nil || cp.Disk.InRootfs == nil || cp.Checkpoint == nil {
		t.Fatalf("checkpoint: %+v", cp)
	}
	resume := srcPod.vm.ResumeCounter()
	srcPod.vm.Kill()

	copies := p.copyEverywhere(t, tools, "vms/pod", "vm")
	p.src.Stop()
	for _, tool := range tools {
		index := copies[tool.name] + "@" + cp.Checkpoint.Digest
		lay := t.TempDir()
		runTool(t, nil, "skopeo", "copy", "--quiet", "--preserve-digests", "--src-cert-dir", p.dst.CertDir, "--src-authfile", p.dst.AuthFile,
			"docker://"+copies[tool.name]+"@"+cp.Rootfs.Digest, "oci:"+lay)
		img := ctrd.ImportLayout(t, lay, onlyManifest(t, lay, cp.Rootfs.Digest), "vmsnap.test/"+tool.name+"@"+cp.Rootfs.Digest)
		dst := startPodVM(t, ctrd, guest.Options{Incoming: true}, podOptions{image: img, layerDisk: inPod})
		rs := cliJSON[api.RestoreResult](t, append([]string{"restore", "--image", index}, agentArgs(dst)...)...)
		if rs.VMState == nil || rs.VMState.Checkpoint != index || rs.Endpoint == nil || rs.Endpoint.PodUID != dst.uid {
			t.Fatalf("the agent's restore from %s's copy: %+v", tool.name, rs)
		}
		assertResumed(t, dst.vm, before, resume, resume)
		dst.vm.Kill()
	}
}

// onlyManifest is the one manifest of the OCI layout dir, which must be d.
func onlyManifest(t *testing.T, dir, d string) ocispec.Descriptor {
	t.Helper()
	var idx ocispec.Index
	b, err := os.ReadFile(filepath.Join(dir, "index.json"))
	if err == nil {
		err = json.Unmarshal(b, &idx)
	}
	if err != nil || len(idx.Manifests) != 1 || idx.Manifests[0].Digest.String() != d {
		t.Fatalf("the layout %s holds %+v (%v), want the manifest %s", dir, idx.Manifests, err, d)
	}
	return idx.Manifests[0]
}
