package e2e

// The node agent end to end: a real containerd running a container labelled
// like a kubelet's, whose volume holds the QMP socket of a real QEMU guest;
// the agent as its own process (so it can be killed); the Job client.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/ocischema"
	"github.com/vmsnap/vmsnap/ociimage"
)

var vmsnapBinary struct {
	once sync.Once
	path string
	err  error
}

// vmsnapPkg is the command these tests drive, built.
const vmsnapPkg = "github.com/vmsnap/vmsnap/cmd/vmsnap"

// binary builds vmsnap once per test run, static (no cgo), so that it
// also runs inside the tests' busybox containers, which have no libc.
func binary(t testing.TB) string {
	t.Helper()
	vmsnapBinary.once.Do(func() {
		dir, err := os.MkdirTemp("", "vmsnap-bin-")
		if err != nil {
			vmsnapBinary.err = err
			return
		}
		vmsnapBinary.path = filepath.Join(dir, "vmsnap")
		build := exec.Command("go", "build", "-o", vmsnapBinary.path, vmsnapPkg)
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		out, err := build.CombinedOutput()
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

// startAgentProc starts `vmsnap agent` on socket, with extra flags after
// the test's own (its policy: --layout-root, --allow-repository,
// --admin-namespace; its bounds).
func startAgentProc(t *testing.T, ctrd *containerd.Daemon, stateDir, socket string, extra ...string) *agentProc {
	t.Helper()
	log, err := os.CreateTemp(t.TempDir(), "agent-*.log")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(binary(t), append([]string{"agent", "--socket", socket, "--state-dir", stateDir,
		"--containerd-address", ctrd.Address, "--containerd-namespace", containerd.Namespace, "--log-level", "debug",
		// The test pods' volumes are the tests' temporary directories, not
		// a kubelet's (TestResolverOpensOnlyThePodsOwnVolumes checks that).
		"--kubelet-pods-dir", ""}, extra...)...)
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

// tempRoot is the directory of the test's t.TempDir()s: the layout root
// of an agent whose tests keep their layouts in them (the state directory,
// a sibling, stays out of every layout).
func tempRoot(t *testing.T) string { return filepath.Dir(t.TempDir()) }

func (p *agentProc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// podVM is a test guest whose directory is a volume of a container of a
// pod: what the agent finds through containerd.
type podVM struct {
	vm        *guest.VM
	uid       string
	container *containerd.Container
	dir       string
	monitor   string // a second QMP socket for the test's own eyes
	// layerDisk is the host path of the disk overlay in the container's
	// root filesystem (podOptions.layerDisk), or "".
	layerDisk string
}

// podOptions are where a podVM's container and disk differ from the
// default (a busybox container, the disk, if any, on the volume).
type podOptions struct {
	image client.Image // the container's image
	// layerDisk, if set, is the path of the VM's disk overlay inside the
	// container, in its writable layer (not on a volume), ending in
	// /overlay.qcow2. Unless the image has it already, a new overlay and
	// its base are created there. guest.Options.Disk must be empty.
	layerDisk string
	namespace string // the pod's ("default" if empty)
}

// qmpInPod is the guest's QMP socket as the container sees it.
func (p *podVM) qmpInPod() string {
	return containerd.DefaultMountPath + "/" + filepath.Base(p.vm.QMPPath())
}

func (p *podVM) status(t *testing.T) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	raw, err := guest.QMP(ctx, p.monitor, "query-status", nil)
	if err != nil {
		t.Fatalf("query-status on the test's monitor: %v", err)
	}
	var st struct{ Status string }
	_ = json.Unmarshal(raw, &st)
	return st.Status
}

// startPodVM starts a pod's container whose volume is opts.Dir, then the
// guest, whose QMP socket is in that volume (QEMU itself runs on the host).
func startPodVM(t *testing.T, ctrd *containerd.Daemon, opts guest.Options, pod podOptions) *podVM {
	t.Helper()
	if opts.Dir == "" {
		opts.Dir = guest.FreeShortDir(t)
	}
	uid := containerd.NewPodUID()
	c := ctrd.Create(t, containerd.PodContainer{PodUID: uid, PodNamespace: pod.namespace, Name: "qemu", HostDir: opts.Dir, Image: pod.image})
	p := &podVM{uid: uid, container: c, dir: opts.Dir, monitor: filepath.Join(opts.Dir, "test-mon.sock")}
	if pod.layerDisk != "" {
		if opts.Disk != "" || filepath.Base(pod.layerDisk) != "overlay.qcow2" {
			t.Fatalf("startPodVM: a disk in the writable layer is DIR/overlay.qcow2, and the only disk (%q, %q)", pod.layerDisk, opts.Disk)
		}
		// Through the container's root filesystem as its task sees it:
		// what is written there lands in its writable layer.
		p.layerDisk = filepath.Join(ctrd.RootfsDir(c), pod.layerDisk)
		if _, err := os.Stat(p.layerDisk); err != nil {
			if err := os.MkdirAll(filepath.Dir(p.layerDisk), 0o755); err != nil {
				t.Fatal(err)
			}
			guest.NewDisk(t, filepath.Dir(p.layerDisk))
		}
		opts.Disk = p.layerDisk
	}
	opts.ExtraArgs = append(opts.ExtraArgs, "-qmp", "unix:"+p.monitor+",server=on,wait=off")
	p.vm = guest.Start(t, opts)
	return p
}

func TestAgentE2EJobCheckpointAndAgentRestore(t *testing.T) {
	ctrd := containerd.Start(t)
	guest.Assets(t)
	dir := guest.FreeShortDir(t)
	src := startPodVM(t, ctrd, guest.Options{Dir: dir, Disk: guest.NewDisk(t, dir)}, podOptions{})
	before, err := src.vm.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter >= 1 })
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(guest.FreeShortDir(t), "agent.sock")
	startAgentProc(t, ctrd, t.TempDir(), sock, "--layout-root", tempRoot(t))
	store := filepath.Join(t.TempDir(), "store")
	termLog := filepath.Join(t.TempDir(), "termination-log")

	// The Job's command line: paths as the QEMU container sees them.
	cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--agent", "unix://"+sock, "--pod-uid", src.uid, "--container", "qemu",
		"--qmp", src.qmpInPod(), "--disk", containerd.DefaultMountPath+"/overlay.qcow2",
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
	dst := startPodVM(t, ctrd, guest.Options{Dir: tdir, Disk: filepath.Join(tdir, "overlay.qcow2"), Incoming: true}, podOptions{})
	rs := cliJSON[api.RestoreResult](t, "restore", "--agent", "unix://"+sock, "--pod-uid", dst.uid, "--container", "qemu",
		"--qmp", dst.qmpInPod(), "--image", cp.VMState.Image)
	if rs.Endpoint == nil || rs.Endpoint.PodUID != dst.uid || rs.Endpoint.QMPPath != dst.qmpInPod() {
		t.Fatalf("the restore result does not carry the new endpoint: %+v", rs.Endpoint)
	}
	assertResumed(t, dst.vm, before, resume, resume)

	// A wrong pod UID is VM_NOT_FOUND, at once: the request itself is
	// refused, no operation started (TestAgentRefusesUnknownVMAtOnce).
	cliError(t, errcode.VMNotFound, "checkpoint", "--agent", "unix://"+sock, "--pod-uid", containerd.NewPodUID(), "--container", "qemu",
		"--qmp", "/run/vm/vm1.qmp", "--image", "oci:"+store+":x")
}

// A guest big enough that its checkpoint takes a moment under TCG.
func bigGuest(dir string) guest.Options {
	return guest.Options{Dir: dir, MemMB: 512, GuestMemMB: 160}
}

func TestAgentE2EBusyAndDeletedContainer(t *testing.T) {
	t.Parallel()
	ctrd := containerd.Start(t)
	guest.Assets(t)
	src := startPodVM(t, ctrd, bigGuest(guest.FreeShortDir(t)), podOptions{})
	if _, err := src.vm.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter >= 1 }); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(guest.FreeShortDir(t), "agent.sock")
	startAgentProc(t, ctrd, t.TempDir(), sock, "--layout-root", tempRoot(t))
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
	if _, err := p.vm.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > last.Counter }); err != nil {
		t.Fatalf("the guest does not count on: %v", err)
	}
}

func TestAgentE2EKilledAgentContinuesVMOnRestart(t *testing.T) {
	t.Parallel()
	ctrd := containerd.Start(t)
	guest.Assets(t)
	src := startPodVM(t, ctrd, bigGuest(guest.FreeShortDir(t)), podOptions{})
	if _, err := src.vm.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter >= 1 }); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(guest.FreeShortDir(t), "agent.sock")
	stateDir := t.TempDir()
	p := startAgentProc(t, ctrd, stateDir, sock, "--layout-root", tempRoot(t))
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
	startAgentProc(t, ctrd, stateDir, sock, "--layout-root", tempRoot(t))
	waitRunning(t, src)
	o, err := c.Get(context.Background(), op.ID)
	if err != nil || o.State != api.StateFailed || !strings.Contains(o.Error.Message, "continued") {
		t.Fatalf("the interrupted operation after restart: %+v, %v", o, err)
	}
}

// layoutTag returns the digest the tag names in the layout dir, or "".
func layoutTag(t *testing.T, dir, tag string) string {
	t.Helper()
	repo, err := ociimage.Open(context.Background(), ociimage.Reference{Layout: dir, Tag: tag})
	if err != nil {
		t.Fatal(err)
	}
	d, err := repo.Resolve(context.Background())
	if err != nil {
		return ""
	}
	return d.Digest.String()
}

// checkpointIndex reads the checkpoint index a checkpoint's result names,
// verified.
func checkpointIndex(t *testing.T, cp api.CheckpointResult) ocispec.Index {
	t.Helper()
	ref, err := ociimage.ParseReference(cp.Checkpoint.Image)
	if err != nil || !ref.IsDigest() || ref.Digest.String() != cp.Checkpoint.Digest {
		t.Fatalf("%s is not pinned to %s (%v)", cp.Checkpoint.Image, cp.Checkpoint.Digest, err)
	}
	repo, err := ociimage.Open(context.Background(), ref)
	if err != nil {
		t.Fatal(err)
	}
	desc, err := repo.Resolve(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	idx, err := repo.Index(context.Background(), desc)
	if err != nil {
		t.Fatalf("%s: %v", cp.Checkpoint.Image, err)
	}
	return idx
}

// pinnedManifest resolves a REF@sha256 reference in its store and returns
// the manifest, verified.
func pinnedManifest(t *testing.T, image, digest string) (ocispec.Descriptor, ocispec.Manifest) {
	t.Helper()
	ref, err := ociimage.ParseReference(image)
	if err != nil || !ref.IsDigest() || ref.Digest.String() != digest {
		t.Fatalf("%s is not pinned to %s (%v)", image, digest, err)
	}
	repo, err := ociimage.Open(context.Background(), ref)
	if err != nil {
		t.Fatal(err)
	}
	desc, err := repo.Resolve(context.Background())
	if err != nil {
		t.Fatalf("%s does not resolve: %v", image, err)
	}
	m, err := repo.Manifest(context.Background(), desc)
	if err != nil {
		t.Fatalf("%s: %v", image, err)
	}
	return desc, m
}

func fileDigest(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return digest.FromBytes(b).String()
}

// TestAgentE2ECheckpointWithRootfsAndDisk: one checkpoint through the
// agent of a VM whose disk is on a volume stores three images (VM state,
// disk, rootfs) and returns their digests, each resolving in its store; the
// checkpoint's index, beside the state, links the disk and rootfs images in
// the layout beside its own by that layout's name; the rootfs image holds
// nothing of the volume. When the state's store then refuses a manifest,
// the checkpoint fails after the disk and rootfs images of that attempt
// were stored, and no tag has moved.
func TestAgentE2ECheckpointWithRootfsAndDisk(t *testing.T) {
	t.Parallel()
	ctrd := containerd.Start(t)
	guest.Assets(t)
	dir := guest.FreeShortDir(t)
	src := startPodVM(t, ctrd, guest.Options{Dir: dir, Disk: guest.NewDisk(t, dir)}, podOptions{})
	if _, err := src.vm.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter >= 1 }); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(guest.FreeShortDir(t), "agent.sock")
	startAgentProc(t, ctrd, t.TempDir(), sock, "--layout-root", tempRoot(t))
	stores := t.TempDir()
	stateStore, imageStore := filepath.Join(stores, "state"), filepath.Join(stores, "images")
	args := []string{"checkpoint", "--agent", "unix://" + sock, "--pod-uid", src.uid, "--container", "qemu",
		"--qmp", src.qmpInPod(), "--disk", containerd.DefaultMountPath + "/overlay.qcow2",
		"--image", "oci:" + stateStore + ":vm", "--disk-image", "oci:" + imageStore + ":disk",
		"--rootfs-image", "oci:" + imageStore + ":rootfs", "--mode", "snapshot"}
	cp := cliJSON[api.CheckpointResult](t, args...)
	if cp.Disk == nil || cp.Rootfs == nil || cp.Disk.InRootfs != nil || !cp.VMRunning {
		t.Fatalf("checkpoint: %+v (disk %+v, rootfs %+v)", cp, cp.Disk, cp.Rootfs)
	}
	pinnedManifest(t, cp.VMState.Image, cp.VMState.Digest)
	pinnedManifest(t, cp.Disk.Image, cp.Disk.Digest)
	_, rm := pinnedManifest(t, cp.Rootfs.Image, cp.Rootfs.Digest)
	idx := checkpointIndex(t, cp)
	if a := idx.Annotations; len(idx.Manifests) != 1 || a[ociimage.AnnotationDiskLink] != "images@"+cp.Disk.Digest ||
		a[ociimage.AnnotationRootfsLink] != "images@"+cp.Rootfs.Digest || a[ociimage.AnnotationDiskRootfsPath] != "" {
		t.Errorf("the checkpoint index lists %d images and links %v", len(idx.Manifests), a)
	}
	if layoutTag(t, stateStore, "vm") != cp.Checkpoint.Digest || layoutTag(t, imageStore, "disk") != cp.Disk.Digest ||
		layoutTag(t, imageStore, "rootfs") != cp.Rootfs.Digest {
		t.Fatal("the tags do not name the checkpoint's images")
	}
	// Both layouts, the rootfs image's config from containerd's image
	// included, pass the image spec's schemas.
	for _, dir := range []string{stateStore, imageStore} {
		if _, err := ocischema.Layout(context.Background(), dir); err != nil {
			t.Fatalf("%s against the image spec's schemas: %v", dir, err)
		}
	}
	for name := range containerd.TopLayer(t, imageStore, rm) {
		if strings.Contains(name, "overlay.qcow2") || strings.Contains(name, ".qmp") {
			t.Errorf("the rootfs layer holds %s, from the volume", name)
		}
	}
	ins := cliJSON[snapshot.InspectResult](t, "inspect", cp.Checkpoint.Image)
	if c := ins.Checkpoint; c == nil || c.VMState != cp.VMState.Image || c.Disk != cp.Disk.Image || c.Rootfs != cp.Rootfs.Image || c.DiskInRootfs != nil ||
		ins.LinkedDisk == nil || ins.LinkedRootfs == nil || ins.LinkedRootfs.Layer != cp.Rootfs.Layer {
		t.Fatalf("inspect does not show the checkpoint's images: %+v (linked rootfs %+v)", ins.Checkpoint, ins.LinkedRootfs)
	}
	if out, code := cli(t, "inspect", cp.Checkpoint.Image); code != 0 || !strings.Contains(string(out), "disk:    "+cp.Disk.Image) ||
		!strings.Contains(string(out), "rootfs:  "+cp.Rootfs.Image) {
		t.Fatalf("inspect's text does not show the checkpoint's images:\n%s", out)
	}

	// The container writes (its rootfs image changes), and the state's
	// store refuses manifests: its index cannot be locked for the update.
	if err := os.WriteFile(filepath.Join(ctrd.RootfsDir(src.container), "changed"), []byte("after the first checkpoint\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	lock := filepath.Join(stateStore, "index.json.lock")
	if err := os.Remove(lock); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(lock, 0o755); err != nil {
		t.Fatal(err)
	}
	cliError(t, errcode.RegistryError, args...)
	if m := layoutManifests(t, imageStore); len(m) < 3 {
		t.Fatalf("the failed checkpoint stored no new rootfs image, so the test proves nothing: %v", m)
	}
	if layoutTag(t, stateStore, "vm") != cp.Checkpoint.Digest || layoutTag(t, imageStore, "disk") != cp.Disk.Digest ||
		layoutTag(t, imageStore, "rootfs") != cp.Rootfs.Digest {
		t.Fatal("a failed checkpoint moved a tag")
	}
	waitRunning(t, src)
}

// TestAgentE2EDiskInWritableLayer: a VM whose disk overlay is in its
// container's writable layer, not on a volume. A checkpoint with a rootfs
// image and no disk image stores two images: the overlay rides in the
// rootfs image, byte for byte as it was while the VM was stopped, and the
// result says where. A container started from that image, with a QEMU on
// the overlay in it, resumes the guest with its disk.
func TestAgentE2EDiskInWritableLayer(t *testing.T) {
	t.Parallel()
	ctrd := containerd.Start(t)
	guest.Assets(t)
	const inPod = "/vm/disk/overlay.qcow2"
	src := startPodVM(t, ctrd, guest.Options{}, podOptions{layerDisk: inPod})
	before, err := src.vm.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter >= 1 })
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(guest.FreeShortDir(t), "agent.sock")
	startAgentProc(t, ctrd, t.TempDir(), sock, "--layout-root", tempRoot(t))
	stores := t.TempDir()
	stateStore, imageStore := filepath.Join(stores, "state"), filepath.Join(stores, "images")
	cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--agent", "unix://"+sock, "--pod-uid", src.uid, "--container", "qemu",
		"--qmp", src.qmpInPod(), "--disk", inPod, "--image", "oci:"+stateStore+":vm",
		"--rootfs-image", "oci:"+imageStore+":rootfs", "--mode", "pause")
	if cp.VMRunning || src.status(t) == "running" || cp.Disk == nil || cp.Rootfs == nil {
		t.Fatalf("checkpoint: %+v (VM %s)", cp, src.status(t))
	}
	want := api.DiskInRootfs{Image: cp.Rootfs.Image, Digest: cp.Rootfs.Digest, Path: inPod}
	if cp.Disk.Image != "" || cp.Disk.InRootfs == nil || *cp.Disk.InRootfs != want || cp.Disk.VirtualSize != guest.DiskSizeMB<<20 {
		t.Fatalf("disk result %+v (in rootfs %+v), want it in the rootfs image at %s", cp.Disk, cp.Disk.InRootfs, inPod)
	}
	// Two images, each resolving, and tagged, and the checkpoint's index.
	pinnedManifest(t, cp.VMState.Image, cp.VMState.Digest)
	rdesc, rm := pinnedManifest(t, cp.Rootfs.Image, cp.Rootfs.Digest)
	if n, m := layoutManifests(t, stateStore), layoutManifests(t, imageStore); len(n) != 2 || len(m) != 1 {
		t.Fatalf("the stores hold %v and %v, want the state and its index, and the rootfs image only", n, m)
	}
	if layoutTag(t, stateStore, "vm") != cp.Checkpoint.Digest || layoutTag(t, imageStore, "rootfs") != cp.Rootfs.Digest {
		t.Fatal("the tags do not name the checkpoint's images")
	}
	if a := checkpointIndex(t, cp).Annotations; a[ociimage.AnnotationDiskLink] != "" || a[ociimage.AnnotationRootfsLink] != "images@"+cp.Rootfs.Digest ||
		a[ociimage.AnnotationDiskRootfsPath] != inPod {
		t.Errorf("the checkpoint index links %v", a)
	}
	// The overlay in the image is the one QEMU has (the VM is stopped).
	entries := containerd.TopLayer(t, imageStore, rm)
	if e, ok := entries[strings.TrimPrefix(inPod, "/")]; !ok || e.Digest.String() != fileDigest(t, src.layerDisk) || e.Header.Size != cp.Disk.RawBytes {
		t.Fatalf("the rootfs layer does not hold the overlay as it is (%+v)", e.Header)
	}
	if _, ok := entries["vm/disk/base.qcow2"]; !ok {
		t.Fatal("the rootfs layer does not hold the overlay's base")
	}
	ins := cliJSON[snapshot.InspectResult](t, "inspect", "oci:"+stateStore+":vm")
	if c := ins.Checkpoint; c == nil || c.Disk != "" || c.DiskInRootfs == nil || *c.DiskInRootfs != want || c.Rootfs != cp.Rootfs.Image || ins.LinkedDisk != nil {
		t.Fatalf("inspect does not show the disk in the rootfs image: %+v", ins.Checkpoint)
	}
	if out, code := cli(t, "inspect", cp.Checkpoint.Image); code != 0 || !strings.Contains(string(out), "disk:    in the rootfs image, at "+inPod) ||
		!strings.Contains(string(out), "rootfs:  "+cp.Rootfs.Image) {
		t.Fatalf("inspect's text does not show the checkpoint's images:\n%s", out)
	}
	resume := src.vm.ResumeCounter()
	src.vm.Kill()

	// The restored pod runs the rootfs image: the overlay is in place
	// before QEMU starts, with nothing to restore.
	img := ctrd.ImportLayout(t, imageStore, rdesc, "vmsnap.test/restored@"+cp.Rootfs.Digest)
	dst := startPodVM(t, ctrd, guest.Options{Incoming: true}, podOptions{image: img, layerDisk: inPod})
	rs := cliJSON[api.RestoreResult](t, "restore", "--agent", "unix://"+sock, "--pod-uid", dst.uid, "--container", "qemu",
		"--qmp", dst.qmpInPod(), "--image", cp.VMState.Image)
	if rs.Endpoint == nil || rs.Endpoint.PodUID != dst.uid {
		t.Fatalf("restore: %+v", rs)
	}
	assertResumed(t, dst.vm, before, resume, resume)
}

// TestAgentE2EQMPSocketBeyondAddressLimit: the pod's volume is at a host
// path longer than a unix socket address holds (a node with a long kubelet
// root, or a long volume name): the agent checkpoints the real guest
// through its socket's descriptor, and the image names no host path.
func TestAgentE2EQMPSocketBeyondAddressLimit(t *testing.T) {
	t.Parallel()
	ctrd := containerd.Start(t)
	guest.Assets(t)
	dir := guest.FreeShortDir(t)
	volume := filepath.Join(dir, "var", "lib", "kubelet", "pods", containerd.NewPodUID(), "volumes", "kubernetes.io~empty-dir", "qmp-sock")
	if err := os.MkdirAll(volume, 0o755); err != nil {
		t.Fatal(err)
	}
	// QEMU runs on the host here, and cannot bind so long a path itself: it
	// binds a short one, and the listening socket moves into the volume.
	monitor := filepath.Join(dir, "test-mon.sock")
	vm := guest.Start(t, guest.Options{Dir: dir, ExtraArgs: []string{"-qmp", "unix:" + monitor + ",server=on,wait=off"}})
	uid := containerd.NewPodUID()
	c := ctrd.Create(t, containerd.PodContainer{PodUID: uid, Name: "qemu", HostDir: volume})
	sockPath := filepath.Join(volume, "qmp.sock")
	if err := os.Rename(vm.QMPPath(), sockPath); err != nil {
		t.Fatal(err)
	}
	if len(sockPath) <= 107 {
		t.Fatalf("the socket's host path is %d bytes: not beyond the limit", len(sockPath))
	}
	src := &podVM{vm: vm, uid: uid, container: c, dir: volume, monitor: monitor}
	if _, err := vm.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter >= 1 }); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(guest.FreeShortDir(t), "agent.sock")
	startAgentProc(t, ctrd, t.TempDir(), sock, "--layout-root", tempRoot(t))
	store := filepath.Join(t.TempDir(), "store")
	cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--agent", "unix://"+sock, "--pod-uid", uid, "--container", "qemu",
		"--qmp", containerd.DefaultMountPath+"/qmp.sock", "--image", "oci:"+store+":vm", "--mode", "pause")
	if cp.VMRunning || src.status(t) == "running" || cp.VMState.RawBytes == 0 {
		t.Fatalf("checkpoint through a %d-byte socket path: %+v (VM %s)", len(sockPath), cp, src.status(t))
	}
	blobs, _ := filepath.Glob(filepath.Join(store, "blobs", "sha256", "*"))
	for _, b := range append(blobs, filepath.Join(store, "index.json")) {
		if data, err := os.ReadFile(b); err != nil || bytes.Contains(data, []byte(dir)) {
			t.Fatalf("%s holds the host path %s (%v)", b, dir, err)
		}
	}
}

// runBinary runs the built vmsnap with args, as a user would, and returns
// its exit status; it fails the test if the binary cannot be started.
func runBinary(t testing.TB, args []string, stdout, stderr io.Writer) int {
	t.Helper()
	cmd := exec.Command(binary(t), args...)
	cmd.Stdout, cmd.Stderr = stdout, stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if errors.As(err, &exit) && exit.Exited() {
		return exit.ExitCode()
	}
	if err != nil {
		t.Fatalf("running vmsnap %s: %v", strings.Join(args, " "), err)
	}
	return 0
}
