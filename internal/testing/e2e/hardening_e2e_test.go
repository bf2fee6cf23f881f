package e2e

// The restore init container's hardening, proven rather than read: the
// container that manifests.RestoreInit describes is translated into the OCI
// spec a kubelet and containerd's CRI plugin would give it (non-root user,
// read-only root, no capabilities, no new privileges, the RuntimeDefault
// seccomp profile, CPU and memory limits, only its volumes writable), and run
// by runc through the test's own containerd. It pulls and verifies a real
// snapshot of a running guest into its volume; a QEMU on the host then loads
// the staged state with -incoming "exec:vmsnap stream --dir ..." and the
// guest carries on. Then the same spec is shown to refuse what it should
// (with a control run for each restriction: lift it alone and the same probe
// succeeds, so the probe tests that restriction and nothing else), and a
// corrupt snapshot is refused inside the container with nothing staged.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/contrib/seccomp"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/pkg/oci"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	corev1 "k8s.io/api/core/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/manifests"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/ociimage"
)

// hardSnapshotMount is where the test mounts the snapshot's OCI layout,
// read-only, in the init container. In a cluster the snapshot comes from a
// registry; a layout on a read-only mount stands in for it here.
const hardSnapshotMount = "/snapshot"

// hardProbeRootFile is a world-writable file in the probe image: only the
// read-only root file system keeps the container's user from writing it.
const hardProbeRootFile = "/probe-data/world-writable"

func TestHardeningRestoreInitContainer(t *testing.T) {
	t.Parallel()
	timings := &hardTimings{}
	defer timings.log(t)

	// Everything the test needs, or a loud skip (a failure in CI).
	ctrd := containerd.Start(t)
	guest.Assets(t)

	o := manifests.Options{}
	uid, gid := int64(manifests.DefaultNonRootUser), int64(manifests.DefaultNonRootUser)
	ref, _ := manifests.RestoreInitContainer(o)
	if sc := ref.SecurityContext; sc == nil || sc.RunAsUser == nil || *sc.RunAsUser != uid || sc.RunAsGroup == nil || *sc.RunAsGroup != gid {
		t.Fatalf("the manifest's init container no longer runs as %d:%d: %+v", uid, gid, ref.SecurityContext)
	}

	// 1. A static vmsnap, and images holding only it (and, for the probes,
	// only a static probe program).
	start := time.Now()
	work := t.TempDir()
	bin := staticVmsnap(t, work)
	probeBin := hardBuildStatic(t, work, "probe", hardProbeSource)
	timings.add("build static vmsnap and probe", start)

	start = time.Now()
	restoreImage := ctrd.ImportImage(t, "vmsnap.test/vmsnap-restore:hardening",
		[]containerd.File{{Path: "/usr/local/bin/vmsnap", HostPath: bin}},
		containerd.ImageConfig{Cmd: []string{"vmsnap"}, Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin"}})
	probeImage := ctrd.ImportImage(t, "vmsnap.test/vmsnap-probe:hardening",
		[]containerd.File{
			{Path: "/probe", HostPath: probeBin},
			{Path: hardProbeRootFile, Data: []byte("image data\n"), Mode: 0o666},
		},
		containerd.ImageConfig{Cmd: []string{"/probe"}, Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin"}})
	timings.add("import the two images", start)

	// 2. A real snapshot: boot the guest, checkpoint it in pause mode with
	// its disk into an OCI layout.
	start = time.Now()
	srcDir := guest.FreeShortDir(t)
	src, before := bootSource(t, srcDir)
	timings.add("boot the source guest", start)
	start = time.Now()
	store := filepath.Join(guest.FreeShortDir(t), "store")
	cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":vm",
		"--disk", filepath.Join(srcDir, "overlay.qcow2"), "--disk-image", "oci:"+store+":vm-disk", "--mode", "pause")
	timings.add("checkpoint (pause mode, with disk)", start)
	if cp.Disk == nil || cp.VMRunning {
		t.Fatalf("unexpected checkpoint result: %+v", cp)
	}
	resume := src.ResumeCounter()
	src.Kill()
	srcOverlaySum := hardFileSum(t, filepath.Join(srcDir, "overlay.qcow2"))
	stateRef := hardInContainerRef(t, cp.VMState.Image)
	diskRef := hardInContainerRef(t, cp.Disk.Image)
	storeBefore := hardTreeSums(t, store)

	// 3. The init container, exactly as the manifest builds it, with only
	// the image references filled in.
	c, vols := manifests.RestoreInit(o, manifests.Restore{Image: stateRef, DiskImage: diskRef})
	hardCheckVolumes(t, c, vols)
	pv := hardNewPodVolumes(t, o, srcDir, uid, gid)
	spec := hardTranslate(t, c, pv.byName, pv.termLog, hardRO(store))
	t.Logf("restrictions applied (from manifests.RestoreInit's container):\n  %s", strings.Join(spec.applied, "\n  "))

	start = time.Now()
	res := hardRun(t, ctrd, restoreImage, spec, nil, func(ctx context.Context, cont client.Container) {
		hardCheckRuntimeSpec(t, ctx, cont, uint32(uid), uint32(gid))
	})
	timings.add("init container: pull + verify state and disk into the volumes", start)
	if res.code != 0 {
		t.Fatalf("the hardened init container failed (exit %d):\n%s", res.code, res.out)
	}
	hardNoRootfsWrites(t, res)
	t.Logf("the container's writable layer holds only the mount points runc made: %v", res.dirs)

	// The staged layout and the overlay are in the host's volume
	// directories, owned by the container's user, nothing left half-written.
	hardCheckStaged(t, pv.state, cp.VMState.Digest)
	hardCheckOwnedBy(t, pv.state, uid, gid)
	overlay := filepath.Join(pv.disk, "overlay.qcow2")
	hardCheckOwnedBy(t, overlay, uid, gid)
	// rootfs asks for 0660; the container's umask (022, as in a pod)
	// leaves 0640. Either way: the owner reads and writes, others nothing.
	if fi, err := os.Stat(overlay); err != nil || fi.Mode().Perm()&0o600 != 0o600 || fi.Mode().Perm()&0o007 != 0 {
		t.Fatalf("restored overlay: %v, mode %v; want rw for the owner and nothing for others", err, fi.Mode())
	} else {
		t.Logf("restored overlay mode %v", fi.Mode().Perm())
	}
	if got := hardFileSum(t, overlay); got != srcOverlaySum {
		t.Errorf("the restored overlay differs from the source's overlay at checkpoint time")
	}
	hardNoTempFiles(t, pv.root)
	var termRes api.RestoreResult
	hardReadJSON(t, pv.termLog, &termRes)
	if termRes.Staged == nil || termRes.Staged.Digest != cp.VMState.Digest || termRes.Staged.Dir != hardDefaults(o).RestoreStateDir ||
		termRes.Disk == nil || termRes.Disk.Digest != cp.Disk.Digest || termRes.Disk.Path != manifests.DefaultRestoreDiskPath {
		t.Fatalf("the termination log does not hold the restore's result: %+v", termRes)
	}
	if after := hardTreeSums(t, store); !reflect.DeepEqual(after, storeBefore) {
		t.Fatalf("the read-only snapshot layout changed during the restore")
	}

	// 3b. The init container runs again in the same pod (its sandbox was
	// recreated): the marker of the first run keeps the overlay, which the
	// guest may have written to since, and the staged state as they are.
	start = time.Now()
	hardRerunKeepsOverlay(t, ctrd, restoreImage, spec, pv, cp.VMState.Digest)
	timings.add("init container re-run: finds its marker, replaces nothing", start)

	// 4. QEMU on the host loads the staged state through `vmsnap stream`
	// and runs the restored overlay: the guest carries on.
	start = time.Now()
	// vmsnap stream gets a monitor of its own, to continue the VM once
	// loaded; the test watches through the harness's.
	tdir := guest.FreeShortDir(t)
	streamMon := filepath.Join(tdir, "stream.qmp")
	target := guest.Start(t, guest.Options{
		Disk: overlay, Dir: tdir,
		ExtraArgs: []string{"-qmp", "unix:" + streamMon + ",server=on,wait=off",
			"-incoming", "exec:" + bin + " stream --dir " + pv.state + " --qmp " + streamMon},
	})
	loaded := hardWaitLoaded(t, target)
	timings.add("QEMU -incoming exec:vmsnap stream, until loaded", start)
	// The stream records a stopped VM; vmsnap stream --qmp continues it.
	for deadline := time.Now().Add(30 * time.Second); loaded != "running"; loaded = hardWaitLoaded(t, target) {
		if loaded != "paused" || time.Now().After(deadline) {
			t.Fatalf("after the incoming load the VM is %q, want vmsnap stream --qmp to have continued it\n%s", loaded, target.Stderr())
		}
		time.Sleep(50 * time.Millisecond)
	}
	start = time.Now()
	assertResumed(t, target, before, resume, resume)
	timings.add("resumed guest prints its next status lines", start)
	target.Kill()
	if t.Failed() {
		return
	}

	// 5a. vmsnap itself, same spec, writing where the spec forbids: the
	// root file system and the snapshot mount. The snapshot layout is made
	// writable for the container's user first, so that only the mount's
	// read-only flag stands in the way.
	if err := os.Chmod(store, 0o777); err != nil {
		t.Fatal(err)
	}
	storeBefore = hardTreeSums(t, store)
	for _, tc := range []struct{ name, toDir string }{
		{"to-dir on the root", "/"},
		{"to-dir under /tmp", "/tmp/vmstate"},
		{"to-dir in the snapshot mount", hardSnapshotMount + "/staged"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			pv := hardNewPodVolumes(t, o, srcDir, uid, gid)
			spec := hardTranslate(t, c, pv.byName, pv.termLog, hardRO(store))
			args := []string{"vmsnap", "restore", "--image", stateRef, "--to-dir", tc.toDir}
			res := hardRun(t, ctrd, restoreImage, spec, args, nil)
			timings.add("refused write: "+tc.name, start)
			if res.code == 0 {
				t.Fatalf("vmsnap restore --to-dir %s succeeded in the hardened container:\n%s", tc.toDir, res.out)
			}
			if !strings.Contains(res.out, "read-only file system") {
				t.Fatalf("the failure does not say the file system is read-only:\n%s", res.out)
			}
			t.Logf("refused as it should be (exit %d): %s", res.code, strings.TrimSpace(res.out))
			hardNoRootfsWrites(t, res)
			if after := hardTreeSums(t, store); !reflect.DeepEqual(after, storeBefore) {
				t.Fatalf("the read-only snapshot layout changed")
			}
		})
	}

	// 5b. Probes, same spec, and a control run for each restriction.
	t.Run("probes", func(t *testing.T) {
		hardProbes(t, ctrd, probeImage, c, o, srcDir, probeBin, uid, gid, timings)
	})

	// 6. A corrupt chunk: the init container fails with DIGEST_MISMATCH
	// and stages nothing QEMU could load.
	t.Run("corrupt chunk", func(t *testing.T) {
		start := time.Now()
		own := filepath.Join(t.TempDir(), "store")
		copyTree(t, store, own)
		layers := manifestLayers(t, own, strings.TrimPrefix(cp.VMState.Digest, "sha256:"))
		if len(layers) == 0 {
			t.Fatal("the state image has no chunks")
		}
		flipByte(t, filepath.Join(own, "blobs", "sha256", layers[len(layers)/2]))
		pv := hardNewPodVolumes(t, o, srcDir, uid, gid)
		spec := hardTranslate(t, c, pv.byName, pv.termLog, hardRO(own))
		res := hardRun(t, ctrd, restoreImage, spec, nil, nil)
		timings.add("init container refusing a corrupt chunk", start)
		if int(res.code) != errcode.DigestMismatch.ExitStatus() || !strings.Contains(res.out, string(errcode.DigestMismatch)) {
			t.Fatalf("exit %d (want %d) and output:\n%s\nwant %s", res.code, errcode.DigestMismatch.ExitStatus(), res.out, errcode.DigestMismatch)
		}
		t.Logf("refused as it should be (exit %d): %s", res.code, strings.TrimSpace(res.out))
		var doc api.ErrorDoc
		hardReadJSON(t, pv.termLog, &doc)
		if doc.Error.Code != errcode.DigestMismatch {
			t.Fatalf("termination log: %+v, want %s", doc, errcode.DigestMismatch)
		}
		if tags := hardLayoutTags(t, pv.state); slices.Contains(tags, snapshot.StagedTag) {
			t.Fatalf("a corrupt snapshot was staged: the state volume's layout is tagged %v", tags)
		}
		hardNoRootfsWrites(t, res)
		// And `vmsnap stream` finds nothing to feed QEMU.
		cmd := exec.Command(bin, "stream", "--dir", pv.state)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		if err == nil || stdout.Len() != 0 {
			t.Fatalf("vmsnap stream of the refused staging: err %v, %d bytes on stdout", err, stdout.Len())
		}
		t.Logf("vmsnap stream --dir of the refused staging: %v: %s", err, strings.TrimSpace(stderr.String()))
	})
}

// hardRerunKeepsOverlay runs the init container a second time on the same
// pod volumes and checks that nothing was replaced and that its log says
// so.
func hardRerunKeepsOverlay(t *testing.T, ctrd *containerd.Daemon, img client.Image, spec hardSpec, pv *hardPodVolumes, stateDigest string) {
	t.Helper()
	overlay := filepath.Join(pv.disk, "overlay.qcow2")
	marker := filepath.Join(pv.markers, "restored-sha256-"+strings.TrimPrefix(stateDigest, "sha256:"))
	if _, err := os.Stat(marker); err != nil {
		t.Fatalf("the first run left no marker: %v", err)
	}
	// A replacement would be a new file renamed into place: a new inode.
	before, sum := hardStat(t, overlay), hardFileSum(t, overlay)
	stateBefore := hardTreeSums(t, pv.state)
	res := hardRun(t, ctrd, img, spec, nil, nil)
	if res.code != 0 {
		t.Fatalf("the re-run failed (exit %d):\n%s", res.code, res.out)
	}
	if !strings.Contains(res.out, "already done in this pod (marker "+manifests.DefaultRestoreMarkerDir+"/") {
		t.Fatalf("the re-run's log does not say the restore was done already:\n%s", res.out)
	}
	after := hardStat(t, overlay)
	if after.Ino != before.Ino || after.Mtim != before.Mtim || hardFileSum(t, overlay) != sum {
		t.Fatalf("the re-run replaced the overlay: inode %d -> %d, mtime %v -> %v", before.Ino, after.Ino, before.Mtim, after.Mtim)
	}
	if !reflect.DeepEqual(hardTreeSums(t, pv.state), stateBefore) {
		t.Fatal("the re-run changed the staged state")
	}
	t.Logf("re-run kept the overlay (inode %d, mtime and content unchanged): %s", after.Ino, strings.TrimSpace(res.out))
}

func hardStat(t *testing.T, p string) syscall.Stat_t {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st
}

// hardWaitLoaded waits for a QEMU started with -incoming exec: to finish
// loading, and returns its run state then.
func hardWaitLoaded(t *testing.T, vm *guest.VM) string {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if vm.Exited() {
			t.Fatalf("QEMU exited while loading the staged state: %v\n%s", vm.ExitErr(), vm.Stderr())
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		raw, err := vm.QMP(ctx, "query-status", nil)
		cancel()
		var st struct{ Status string }
		if err == nil && json.Unmarshal(raw, &st) == nil && st.Status != "inmigrate" {
			return st.Status
		}
		if time.Now().After(deadline) {
			t.Fatalf("QEMU still loading after 2 minutes (last: %s, %v)\n%s", st.Status, err, vm.Stderr())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitLoadedRunning waits until QEMU has loaded the staged state and runs on
// (the loader continues it), for a minute at the most.
func waitLoadedRunning(t *testing.T, vm *guest.VM) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if st := hardWaitLoaded(t, vm); st == "running" {
			return
		} else if time.Now().After(deadline) {
			t.Fatalf("after the load the VM is %q\n%s", st, vm.Stderr())
		}
	}
}

// ---------------------------------------------------------------------------
// Translating the manifest's container into an OCI spec.

// hardSpec is what a kubelet and CRI would give containerd for the container.
type hardSpec struct {
	args    []string
	mounts  []specs.Mount
	opts    []oci.SpecOpts
	applied []string // the restrictions, for the log
}

// hardRO is the extra read-only bind mount of a snapshot layout.
func hardRO(dir string) specs.Mount {
	return specs.Mount{Destination: hardSnapshotMount, Type: "bind", Source: dir, Options: []string{"rbind", "rprivate", "ro"}}
}

// hardTranslate turns the manifest's container into the process, mounts and
// security settings of a runc container, refusing any security setting it
// does not know how to translate (so that a change to the manifest cannot
// slip past this test). hostDirs maps each volume name to a host directory.
func hardTranslate(t *testing.T, c corev1.Container, hostDirs map[string]string, termLog string, extra ...specs.Mount) hardSpec {
	t.Helper()
	var s hardSpec
	s.args = append(append([]string(nil), c.Command...), c.Args...)
	if c.WorkingDir != "" || len(c.EnvFrom) > 0 || len(c.VolumeDevices) > 0 {
		t.Fatalf("untranslated container fields: workingDir %q, envFrom %v, volumeDevices %v", c.WorkingDir, c.EnvFrom, c.VolumeDevices)
	}
	// CRI gives a container no /run tmpfs (containerd's client default spec
	// has one): without this, /run would be writable here and not in a pod.
	s.opts = append(s.opts, hardWithoutMount("/run"))

	sc := c.SecurityContext
	if sc == nil {
		t.Fatal("the init container has no securityContext")
	}
	rest := *sc
	if sc.Privileged != nil && *sc.Privileged {
		t.Fatal("the init container is privileged")
	}
	rest.Privileged = nil
	if sc.RunAsUser == nil || sc.RunAsGroup == nil {
		t.Fatalf("runAsUser/runAsGroup unset: %+v", sc)
	}
	uid, gid := *sc.RunAsUser, *sc.RunAsGroup
	if sc.RunAsNonRoot != nil && *sc.RunAsNonRoot && uid == 0 {
		t.Fatal("runAsNonRoot with runAsUser 0: the kubelet would refuse to start it")
	}
	s.opts = append(s.opts, hardWithUser(uint32(uid), uint32(gid)))
	s.applied = append(s.applied, fmt.Sprintf("user %d:%d, supplementary groups [%d] (runAsUser, runAsGroup, runAsNonRoot=%v)", uid, gid, gid, hardDeref(sc.RunAsNonRoot)))
	rest.RunAsUser, rest.RunAsGroup, rest.RunAsNonRoot = nil, nil, nil

	// The kubelet's default is allowPrivilegeEscalation: true.
	if sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation {
		s.opts = append(s.opts, oci.WithNoNewPrivileges)
		s.applied = append(s.applied, "no_new_privs (allowPrivilegeEscalation: false)")
	}
	rest.AllowPrivilegeEscalation = nil
	if sc.ReadOnlyRootFilesystem != nil && *sc.ReadOnlyRootFilesystem {
		s.opts = append(s.opts, oci.WithRootFSReadonly())
		s.applied = append(s.applied, "read-only root file system (readOnlyRootFilesystem: true)")
	}
	rest.ReadOnlyRootFilesystem = nil

	var drop, add []string
	if sc.Capabilities != nil {
		for _, c := range sc.Capabilities.Drop {
			drop = append(drop, string(c))
		}
		for _, c := range sc.Capabilities.Add {
			add = append(add, string(c))
		}
	}
	s.opts = append(s.opts, hardWithCapabilities(drop, add))
	s.applied = append(s.applied, fmt.Sprintf("capabilities: runtime defaults, drop %v, add %v, in all five sets (bounding, effective, permitted, inheritable, ambient)", drop, add))
	rest.Capabilities = nil

	// After the capabilities: the default profile depends on them.
	switch {
	case sc.SeccompProfile == nil:
		t.Fatal("the init container sets no seccomp profile")
	case sc.SeccompProfile.Type == corev1.SeccompProfileTypeRuntimeDefault:
		s.opts = append(s.opts, seccomp.WithDefaultProfile())
		s.applied = append(s.applied, "seccomp: containerd's RuntimeDefault profile (contrib/seccomp.DefaultProfile)")
	default:
		t.Fatalf("untranslated seccomp profile %+v", sc.SeccompProfile)
	}
	rest.SeccompProfile = nil
	if !reflect.DeepEqual(rest, corev1.SecurityContext{}) {
		t.Fatalf("untranslated securityContext settings: %+v", rest)
	}

	var env []string
	for _, e := range c.Env {
		if e.ValueFrom != nil {
			t.Fatalf("untranslated env %s (valueFrom)", e.Name)
		}
		env = append(env, e.Name+"="+e.Value)
	}
	if len(env) > 0 {
		s.opts = append(s.opts, oci.WithEnv(env))
		s.applied = append(s.applied, fmt.Sprintf("env %v", env))
	}

	if l, ok := c.Resources.Limits[corev1.ResourceMemory]; ok {
		s.opts = append(s.opts, oci.WithMemoryLimit(uint64(l.Value())))
		s.applied = append(s.applied, fmt.Sprintf("memory limit %s (cgroup)", l.String()))
	}
	if l, ok := c.Resources.Limits[corev1.ResourceCPU]; ok {
		const period = 100000
		s.opts = append(s.opts, oci.WithCPUCFS(l.MilliValue()*period/1000, period))
		s.applied = append(s.applied, fmt.Sprintf("cpu limit %s (CFS quota)", l.String()))
	}
	if l, ok := c.Resources.Limits[corev1.ResourceEphemeralStorage]; ok {
		s.applied = append(s.applied, fmt.Sprintf("NOT applied: ephemeral-storage limit %s (the kubelet enforces it by eviction)", l.String()))
	}

	for _, m := range c.VolumeMounts {
		if m.SubPath != "" || m.SubPathExpr != "" || m.MountPropagation != nil {
			t.Fatalf("untranslated volume mount %+v", m)
		}
		dir, ok := hostDirs[m.Name]
		if !ok {
			t.Fatalf("no host directory for volume %s", m.Name)
		}
		mode := "rw"
		if m.ReadOnly {
			mode = "ro"
		}
		s.mounts = append(s.mounts, specs.Mount{Destination: m.MountPath, Type: "bind", Source: dir, Options: []string{"rbind", "rprivate", mode}})
		s.applied = append(s.applied, fmt.Sprintf("volume %s at %s, %s", m.Name, m.MountPath, mode))
	}
	// The kubelet mounts a writable termination log file in every container.
	termPath := c.TerminationMessagePath
	if termPath == "" {
		termPath = corev1.TerminationMessagePathDefault
	}
	s.mounts = append(s.mounts, specs.Mount{Destination: termPath, Type: "bind", Source: termLog, Options: []string{"rbind", "rprivate", "rw"}})
	s.applied = append(s.applied, "termination log at "+termPath+", rw (as the kubelet mounts it)")
	for _, m := range extra {
		s.mounts = append(s.mounts, m)
		s.applied = append(s.applied, fmt.Sprintf("test's snapshot layout at %s, %s (stands in for the registry)", m.Destination, m.Options[len(m.Options)-1]))
	}
	return s
}

func hardDeref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

func hardWithoutMount(dest string) oci.SpecOpts {
	return func(_ context.Context, _ oci.Client, _ *containers.Container, s *oci.Spec) error {
		s.Mounts = slices.DeleteFunc(s.Mounts, func(m specs.Mount) bool { return m.Destination == dest })
		return nil
	}
}

// hardWithUser sets the user and, as CRI does, the primary group as the
// only supplementary group (the image config would otherwise leave root's
// group 0 there).
func hardWithUser(uid, gid uint32) oci.SpecOpts {
	return func(_ context.Context, _ oci.Client, _ *containers.Container, s *oci.Spec) error {
		s.Process.User = specs.User{UID: uid, GID: gid, AdditionalGids: []uint32{gid}}
		return nil
	}
}

// hardWithCapabilities applies a Kubernetes capabilities drop/add list to
// the runtime's default set, in every set.
func hardWithCapabilities(drop, add []string) oci.SpecOpts {
	return func(_ context.Context, _ oci.Client, _ *containers.Container, s *oci.Spec) error {
		if s.Process.Capabilities == nil {
			s.Process.Capabilities = &specs.LinuxCapabilities{}
		}
		caps := slices.Clone(s.Process.Capabilities.Bounding)
		for _, d := range drop {
			if d == "ALL" {
				caps = nil
				break
			}
			caps = slices.DeleteFunc(caps, func(c string) bool { return c == "CAP_"+d })
		}
		for _, a := range add {
			if !slices.Contains(caps, "CAP_"+a) {
				caps = append(caps, "CAP_"+a)
			}
		}
		s.Process.Capabilities = &specs.LinuxCapabilities{
			Bounding: caps, Effective: slices.Clone(caps), Permitted: slices.Clone(caps),
			Inheritable: []string{}, Ambient: []string{},
		}
		if caps == nil {
			s.Process.Capabilities.Bounding, s.Process.Capabilities.Effective, s.Process.Capabilities.Permitted = []string{}, []string{}, []string{}
		}
		return nil
	}
}

// hardCheckRuntimeSpec reads the spec containerd stored for the container
// and checks the restrictions reached it.
func hardCheckRuntimeSpec(t *testing.T, ctx context.Context, cont client.Container, uid, gid uint32) {
	t.Helper()
	sp, err := cont.Spec(ctx)
	if err != nil {
		t.Fatal(err)
	}
	p := sp.Process
	var problems []string
	if p.User.UID != uid || p.User.GID != gid || !slices.Equal(p.User.AdditionalGids, []uint32{gid}) {
		problems = append(problems, fmt.Sprintf("user %+v", p.User))
	}
	if !p.NoNewPrivileges {
		problems = append(problems, "no_new_privs off")
	}
	if sp.Root == nil || !sp.Root.Readonly {
		problems = append(problems, "root writable")
	}
	if c := p.Capabilities; c == nil || len(c.Bounding)+len(c.Effective)+len(c.Permitted)+len(c.Inheritable)+len(c.Ambient) != 0 {
		problems = append(problems, fmt.Sprintf("capabilities %+v", c))
	}
	if sp.Linux.Seccomp == nil || sp.Linux.Seccomp.DefaultAction == specs.ActAllow {
		problems = append(problems, "no restrictive seccomp profile")
	}
	var writable []string
	for _, m := range sp.Mounts {
		ro := slices.Contains(m.Options, "ro")
		if m.Destination == "/run" {
			problems = append(problems, "a /run tmpfs")
		}
		if !ro && m.Type != "proc" && m.Type != "mqueue" && m.Type != "devpts" {
			writable = append(writable, m.Destination+"("+m.Type+")")
		}
	}
	if len(problems) > 0 {
		t.Fatalf("the container's runtime spec lacks restrictions: %s", strings.Join(problems, "; "))
	}
	mem, cpu := "-", "-"
	if r := sp.Linux.Resources; r != nil {
		if r.Memory != nil && r.Memory.Limit != nil {
			mem = fmt.Sprint(*r.Memory.Limit)
		}
		if r.CPU != nil && r.CPU.Quota != nil && r.CPU.Period != nil {
			cpu = fmt.Sprintf("%d/%d", *r.CPU.Quota, *r.CPU.Period)
		}
	}
	t.Logf("runtime spec as stored by containerd: user %d:%d groups %v, root read-only %v, no_new_privs %v, capabilities (all sets) empty, "+
		"seccomp default action %s with %d rules, memory limit %s bytes, cpu quota %s; writable mounts: %v",
		p.User.UID, p.User.GID, p.User.AdditionalGids, sp.Root.Readonly, p.NoNewPrivileges, sp.Linux.Seccomp.DefaultAction,
		len(sp.Linux.Seccomp.Syscalls), mem, cpu, writable)
}

// ---------------------------------------------------------------------------
// Running a container.

type hardResult struct {
	code  uint32
	out   string
	upper []string // what the container left in its writable layer that is not a directory
	dirs  []string // the directories there (mount points runc made)
}

// hardRun runs the container spec describes (args, or the spec's own
// command) to its end, looks at its snapshot's writable layer, deletes it
// and returns its exit status and output. inspect, if set, runs once the
// container exists.
func hardRun(t *testing.T, ctrd *containerd.Daemon, img client.Image, s hardSpec, args []string, inspect func(context.Context, client.Container), more ...oci.SpecOpts) hardResult {
	t.Helper()
	if args == nil {
		args = s.args
	}
	var out bytes.Buffer
	c := ctrd.Create(t, containerd.PodContainer{
		PodUID: containerd.NewPodUID(), Name: manifests.RestoreContainerName, PodName: "vm-restored",
		Image: img, Args: args, HostDir: "-", Mounts: s.mounts,
		SpecOpts: append(slices.Clone(s.opts), more...),
		Stdout:   &out, Stderr: &out,
	})
	ctx, cancel := context.WithTimeout(ctrd.Context(context.Background()), 3*time.Minute)
	defer cancel()
	if inspect != nil {
		inspect(ctx, c.Container)
	}
	code, err := c.Wait(ctx)
	if err != nil {
		t.Fatalf("container %v: %v", args, err)
	}
	var r hardResult
	r.code = code
	r.upper, r.dirs = hardUpperDir(t, ctx, ctrd, c.ID)
	ctrd.Delete(t, c) // waits for the output to be copied
	r.out = out.String()
	return r
}

// hardUpperDir lists the writable layer of the container's root file
// system: the non-directories, and the directories.
func hardUpperDir(t *testing.T, ctx context.Context, ctrd *containerd.Daemon, id string) (files, dirs []string) {
	t.Helper()
	mounts, err := ctrd.Client.SnapshotService(containerd.Snapshotter).Mounts(ctx, id)
	if err != nil {
		t.Fatalf("snapshot mounts of %s: %v", id, err)
	}
	upper := ""
	for _, m := range mounts {
		for _, o := range m.Options {
			if u, ok := strings.CutPrefix(o, "upperdir="); ok {
				upper = u
			}
		}
	}
	if upper == "" {
		t.Fatalf("no upperdir in the container's snapshot mounts %+v", mounts)
	}
	err = filepath.WalkDir(upper, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(upper, p)
		if rel == "." {
			return nil
		}
		if d.IsDir() {
			dirs = append(dirs, "/"+rel)
		} else {
			files = append(files, "/"+rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files, dirs
}

// hardNoRootfsWrites checks the container wrote nothing to its root file
// system: its writable layer holds only the directories runc made as mount
// points.
func hardNoRootfsWrites(t *testing.T, r hardResult) {
	t.Helper()
	if len(r.upper) > 0 {
		t.Fatalf("the container wrote to its root file system: %v", r.upper)
	}
	allowed := map[string]bool{"/dev": true, "/proc": true, "/sys": true, "/vm": true, "/etc": true, "/etc/vmsnap": true}
	for _, d := range r.dirs {
		if !allowed[d] && !strings.HasPrefix(d, "/vm/") && d != hardSnapshotMount && d != manifests.RegistryConfigDir {
			t.Fatalf("the container's writable layer has a directory that is no mount point: %s (all: %v)", d, r.dirs)
		}
	}
}

// ---------------------------------------------------------------------------
// The pod's volumes on the host.

type hardPodVolumes struct {
	root, state, disk, markers, registry, termLog string
	byName                                        map[string]string
}

// hardNewPodVolumes makes host directories for the init container's
// volumes: the state and disk volumes owned by the container's user (the
// disk one holding a copy of the overlay's base image, as the pod's own
// volume would), the registry secret (an empty docker config, 0444), and a
// termination log file.
func hardNewPodVolumes(t *testing.T, o manifests.Options, srcDir string, uid, gid int64) *hardPodVolumes {
	t.Helper()
	root := guest.FreeShortDir(t)
	v := &hardPodVolumes{
		root: root, state: filepath.Join(root, "state"), disk: filepath.Join(root, "disk"), markers: filepath.Join(root, "markers"),
		registry: filepath.Join(root, "registry"), termLog: filepath.Join(root, "termination-log"),
	}
	for _, d := range []string{v.state, v.disk, v.markers, v.registry} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []string{v.state, v.disk, v.markers} {
		if err := os.Chown(d, int(uid), int(gid)); err != nil {
			t.Fatal(err)
		}
	}
	copyFile(t, filepath.Join(srcDir, "base.qcow2"), filepath.Join(v.disk, "base.qcow2"))
	if err := os.WriteFile(filepath.Join(v.registry, "config.json"), []byte(`{"auths":{}}`+"\n"), 0o444); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(v.termLog, nil, 0o666); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(v.termLog, 0o666); err != nil { // past the umask, as the kubelet does
		t.Fatal(err)
	}
	v.byName = map[string]string{
		hardDefaults(o).RestoreStateVolume:   v.state,
		hardDefaults(o).RestoreDiskVolume:    v.disk,
		manifests.DefaultRestoreMarkerVolume: v.markers,
		manifests.VolumeRegistry:             v.registry,
	}
	return v
}

// hardDefaults returns the volume names the manifests use when the
// options leave them empty.
func hardDefaults(o manifests.Options) manifests.Options {
	if o.RestoreStateVolume == "" {
		o.RestoreStateVolume = manifests.DefaultRestoreStateVolume
	}
	if o.RestoreDiskVolume == "" {
		o.RestoreDiskVolume = manifests.DefaultRestoreDiskVolume
	}
	if o.RestoreStateDir == "" {
		o.RestoreStateDir = manifests.DefaultRestoreStateDir
	}
	return o
}

// hardCheckVolumes checks that every mount of the container has its volume
// and that the writable ones are emptyDirs (the pod's own volumes).
func hardCheckVolumes(t *testing.T, c corev1.Container, vols []corev1.Volume) {
	t.Helper()
	byName := map[string]corev1.Volume{}
	for _, v := range vols {
		byName[v.Name] = v
	}
	for _, m := range c.VolumeMounts {
		v, ok := byName[m.Name]
		if !ok {
			t.Fatalf("mount %s has no volume", m.Name)
		}
		if !m.ReadOnly && v.EmptyDir == nil {
			t.Fatalf("writable mount %s is not an emptyDir: %+v", m.Name, v.VolumeSource)
		}
	}
}

// hardInContainerRef is a checkpoint's image reference as the init
// container sees it: the same digest in the layout at hardSnapshotMount.
func hardInContainerRef(t *testing.T, image string) string {
	t.Helper()
	ref, err := ociimage.ParseReference(image)
	if err != nil || ref.Layout == "" || ref.Digest == "" {
		t.Fatalf("checkpoint image %q is not a pinned layout reference: %v", image, err)
	}
	return "oci:" + hardSnapshotMount + "@" + ref.Digest.String()
}

func hardCheckStaged(t *testing.T, dir, wantDigest string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "index.json"))
	if err != nil {
		t.Fatalf("nothing staged in the state volume: %v", err)
	}
	var idx struct {
		Manifests []struct {
			Digest      string
			Annotations map[string]string
		}
	}
	if err := json.Unmarshal(b, &idx); err != nil {
		t.Fatal(err)
	}
	for _, m := range idx.Manifests {
		if m.Annotations[ociimage.AnnotationRefName] == snapshot.StagedTag {
			if m.Digest != wantDigest {
				t.Fatalf("staged %s, want %s", m.Digest, wantDigest)
			}
			return
		}
	}
	t.Fatalf("the state volume's layout has no %q tag: %s", snapshot.StagedTag, b)
}

func hardLayoutTags(t *testing.T, dir string) []string {
	t.Helper()
	var tags []string
	for _, m := range layoutIndex(t, dir).Manifests {
		if tag := m.Annotations[ociimage.AnnotationRefName]; tag != "" {
			tags = append(tags, tag)
		}
	}
	return tags
}

// hardCheckOwnedBy checks that p and everything under it belongs to uid:gid.
func hardCheckOwnedBy(t *testing.T, p string, uid, gid int64) {
	t.Helper()
	n := 0
	err := filepath.WalkDir(p, func(q string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		st := fi.Sys().(*syscall.Stat_t)
		if int64(st.Uid) != uid || int64(st.Gid) != gid {
			return fmt.Errorf("%s belongs to %d:%d, want %d:%d", q, st.Uid, st.Gid, uid, gid)
		}
		n++
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: %d entries, all owned by %d:%d", p, n, uid, gid)
}

func hardNoTempFiles(t *testing.T, root string) {
	t.Helper()
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err == nil && (strings.Contains(d.Name(), ".tmp") || strings.Contains(d.Name(), "vmsnap-tmp")) {
			t.Errorf("temporary file left behind: %s", p)
		}
		return nil
	})
}

func hardReadJSON(t *testing.T, file string, v any) {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v\n%s", file, err, b)
	}
}

func hardFileSum(t *testing.T, file string) string {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// hardTreeSums maps every path under dir to its type, mode and content hash.
func hardTreeSums(t *testing.T, dir string) map[string]string {
	t.Helper()
	sums := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		v := fi.Mode().String()
		if fi.Mode().IsRegular() {
			v += " " + hardFileSum(t, p)
		}
		sums[rel] = v
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return sums
}

// ---------------------------------------------------------------------------
// Building static binaries.

// hardBuildStatic builds the one-file program source into dir/name, static.
func hardBuildStatic(t *testing.T, dir, name, source string) string {
	t.Helper()
	out := filepath.Join(dir, name)
	srcDir := filepath.Join(dir, name+"-src")
	if err := os.MkdirAll(srcDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(srcDir, "main.go"), []byte(source), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", "build", "-o", out, "main.go")
	cmd.Dir = srcDir
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=", "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building %s: %v\n%s", name, err, b)
	}
	assertStatic(t, out)
	return out
}

// staticVmsnap copies vmsnap, built once for the package (binary, with
// CGO_ENABLED=0), into dir: a container or launcher runs it from there.
func staticVmsnap(t *testing.T, dir string) string {
	t.Helper()
	out := filepath.Join(dir, "vmsnap")
	b, err := os.ReadFile(binary(t))
	if err == nil {
		err = os.WriteFile(out, b, 0o755)
	}
	if err != nil {
		t.Fatal(err)
	}
	assertStatic(t, out)
	return out
}

// assertStatic fails unless the ELF file at path is statically linked: it
// runs in containers without a dynamic loader.
func assertStatic(t *testing.T, path string) {
	t.Helper()
	f, err := elf.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Fatalf("%s is dynamically linked", path)
		}
	}
}

// ---------------------------------------------------------------------------
// Probes.

// hardProbeSource is a static program run in the init container's spec that
// tries what the spec must forbid and prints one NAME=RESULT line for each
// (RESULT is "ok" or the errno), plus the kernel's view of its credentials.
const hardProbeSource = `package main

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"unsafe"
)

func main() {
	if len(os.Args) == 2 && os.Args[1] == "euid" {
		fmt.Println(os.Geteuid())
		return
	}
	if len(os.Args) == 2 && os.Args[1] == "noop" {
		return
	}
	vol := flag.String("volume", "", "a writable volume")
	snap := flag.String("snapshot", "", "the read-only snapshot mount")
	rootFile := flag.String("rootfile", "", "a world-writable file in the image")
	flag.Parse()
	groups, _ := os.Getgroups()
	fmt.Printf("uid=%d\ngid=%d\neuid=%d\ngroups=%v\n", os.Getuid(), os.Getgid(), os.Geteuid(), groups)
	status, _ := os.ReadFile("/proc/self/status")
	for _, l := range strings.Split(string(status), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if ok && (strings.HasPrefix(k, "Cap") || k == "NoNewPrivs" || k == "Seccomp") {
			fmt.Printf("%s=%s\n", k, strings.TrimSpace(v))
		}
	}
	report("rootfs-write", writeTo(*rootFile, os.O_WRONLY|os.O_TRUNC))
	report("snapshot-create", writeTo(filepath.Join(*snap, ".probe"), os.O_WRONLY|os.O_CREATE|os.O_EXCL))
	report("volume-create", writeTo(filepath.Join(*vol, ".probe"), os.O_WRONLY|os.O_CREATE|os.O_EXCL))
	report("chown", os.Chown(filepath.Join(*vol, "mine"), 0, 0))
	report("chmod-others-file", os.Chmod(filepath.Join(*vol, "rootfile"), 0o666))
	_, err := os.ReadFile(filepath.Join(*vol, "secret"))
	report("read-others-0600-file", err)
	l, err := net.Listen("tcp4", "0.0.0.0:80")
	if err == nil {
		l.Close()
	}
	report("bind-port-80", err)
	report("io_uring_setup", ioUring())
	cmd := exec.Command("/proc/self/exe", "noop")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER}
	report("clone-newuser", cmd.Run())
	out, err := exec.Command(filepath.Join(*vol, "suid", "probe"), "euid").Output()
	if err != nil {
		fmt.Printf("setuid-root-exec-euid=%s\n", name(err))
	} else {
		fmt.Printf("setuid-root-exec-euid=%s\n", strings.TrimSpace(string(out)))
	}
}

func writeTo(p string, flags int) error {
	f, err := os.OpenFile(p, flags, 0o644)
	if err != nil {
		return err
	}
	_, err = f.WriteString("probe\n")
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

func ioUring() error {
	var params [120]byte
	fd, _, e := syscall.Syscall(425, 1, uintptr(unsafe.Pointer(&params[0])), 0)
	if e != 0 {
		return e
	}
	syscall.Close(int(fd))
	return nil
}

func report(what string, err error) { fmt.Printf("%s=%s\n", what, name(err)) }

func name(err error) string {
	if err == nil {
		return "ok"
	}
	var e syscall.Errno
	if errors.As(err, &e) {
		switch e {
		case syscall.EROFS:
			return "EROFS"
		case syscall.EACCES:
			return "EACCES"
		case syscall.EPERM:
			return "EPERM"
		case syscall.ENOSYS:
			return "ENOSYS"
		case syscall.EINVAL:
			return "EINVAL"
		case syscall.ENOENT:
			return "ENOENT"
		}
	}
	return strings.ReplaceAll(err.Error(), " ", "_")
}
`

// hardProbes runs the probe with the init container's spec, then once for
// each restriction with that restriction alone lifted: each probe that the
// spec refuses must then succeed, and nothing else may change.
func hardProbes(t *testing.T, ctrd *containerd.Daemon, img client.Image, c corev1.Container, o manifests.Options,
	srcDir, probeBin string, uid, gid int64, timings *hardTimings) {
	stateMount := hardDefaults(o).RestoreStateDir
	run := func(t *testing.T, label string, more ...oci.SpecOpts) map[string]string {
		t.Helper()
		start := time.Now()
		pv := hardNewPodVolumes(t, o, srcDir, uid, gid)
		hardProbeFiles(t, pv.state, probeBin, uid, gid)
		// A scratch layout dir writable by anyone stands at the snapshot
		// mount: only the mount's read-only flag can stop the write.
		snap := t.TempDir()
		if err := os.Chmod(snap, 0o777); err != nil {
			t.Fatal(err)
		}
		mount := hardRO(snap)
		if label == "snapshot mount rw" {
			mount.Options = []string{"rbind", "rprivate", "rw"}
		}
		spec := hardTranslate(t, c, pv.byName, pv.termLog, mount)
		args := []string{"/probe", "-volume", stateMount, "-snapshot", hardSnapshotMount, "-rootfile", hardProbeRootFile}
		res := hardRun(t, ctrd, img, spec, args, nil, more...)
		timings.add("probe: "+label, start)
		if res.code != 0 {
			t.Fatalf("probe (%s) exited %d:\n%s", label, res.code, res.out)
		}
		got := map[string]string{}
		for _, l := range strings.Split(strings.TrimSpace(res.out), "\n") {
			if k, v, ok := strings.Cut(l, "="); ok {
				got[k] = v
			}
		}
		if label == "hardened" {
			hardNoRootfsWrites(t, res)
		}
		return got
	}

	base := run(t, "hardened")
	keys := make([]string, 0, len(base))
	for k := range base {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var lines []string
	for _, k := range keys {
		lines = append(lines, k+"="+base[k])
	}
	t.Logf("probe in the init container's spec:\n  %s", strings.Join(lines, "\n  "))

	want := map[string]string{
		"uid": fmt.Sprint(uid), "gid": fmt.Sprint(gid), "euid": fmt.Sprint(uid), "groups": fmt.Sprintf("[%d]", gid),
		"CapInh": "0000000000000000", "CapPrm": "0000000000000000", "CapEff": "0000000000000000",
		"CapBnd": "0000000000000000", "CapAmb": "0000000000000000",
		"NoNewPrivs": "1", "Seccomp": "2",
		"rootfs-write": "EROFS", "snapshot-create": "EROFS", "volume-create": "ok",
		"chown": "EPERM", "chmod-others-file": "EPERM", "read-others-0600-file": "EACCES", "bind-port-80": "EACCES",
		"io_uring_setup": "EPERM", "clone-newuser": "EPERM", "setuid-root-exec-euid": fmt.Sprint(uid),
	}
	for k, v := range want {
		if base[k] != v {
			t.Errorf("in the hardened container %s=%s, want %s", k, base[k], v)
		}
	}
	if t.Failed() {
		return
	}

	// Each control lifts one restriction; the probes listed must flip to
	// these values, and every other probe must read as in the hardened run.
	hostForbids := hardHostForbids(t)
	grant := []string{"CAP_CHOWN", "CAP_FOWNER", "CAP_DAC_OVERRIDE", "CAP_NET_BIND_SERVICE"}
	for _, ctl := range []struct {
		label string
		opt   oci.SpecOpts
		flips map[string]string
	}{
		{"root file system rw", func(_ context.Context, _ oci.Client, _ *containers.Container, s *oci.Spec) error {
			s.Root.Readonly = false
			return nil
		}, map[string]string{"rootfs-write": "ok"}},
		{"snapshot mount rw", nil, map[string]string{"snapshot-create": "ok"}},
		{"capabilities granted: " + strings.Join(grant, ","), func(_ context.Context, _ oci.Client, _ *containers.Container, s *oci.Spec) error {
			c := s.Process.Capabilities
			c.Bounding, c.Effective, c.Permitted, c.Inheritable, c.Ambient = grant, grant, grant, grant, grant
			return nil
		}, map[string]string{
			"chown": "ok", "chmod-others-file": "ok", "read-others-0600-file": "ok", "bind-port-80": "ok",
			"CapInh": "*", "CapPrm": "*", "CapEff": "*", "CapBnd": "*", "CapAmb": "*",
		}},
		{"no seccomp profile", func(_ context.Context, _ oci.Client, _ *containers.Container, s *oci.Spec) error {
			s.Linux.Seccomp = nil
			return nil
		}, map[string]string{"io_uring_setup": "ok", "clone-newuser": "ok", "Seccomp": "0"}},
		{"privilege escalation allowed", func(_ context.Context, _ oci.Client, _ *containers.Container, s *oci.Spec) error {
			s.Process.NoNewPrivileges = false
			return nil
		}, map[string]string{"setuid-root-exec-euid": "0", "NoNewPrivs": "0"}},
	} {
		t.Run("control "+ctl.label, func(t *testing.T) {
			var more []oci.SpecOpts
			if ctl.opt != nil {
				more = append(more, ctl.opt)
			}
			got := run(t, ctl.label, more...)
			var diffs []string
			for _, k := range keys {
				w, flips := ctl.flips[k]
				if why, ok := hostForbids[k]; ok && flips {
					// The host forbids it by itself: lifting the
					// restriction cannot show anything for this probe.
					t.Logf("NOT PROVEN HERE: %s cannot show %s: %s", k, ctl.label, why)
					flips = false
				}
				switch {
				case flips && w == "*":
					if got[k] == base[k] {
						t.Errorf("%s: %s did not change (%s)", ctl.label, k, got[k])
					}
				case flips:
					if got[k] != w {
						t.Errorf("%s: %s=%s, want %s: the probe does not test this restriction", ctl.label, k, got[k], w)
					}
				default:
					if got[k] != base[k] {
						t.Errorf("%s: %s=%s changed from %s", ctl.label, k, got[k], base[k])
					}
				}
				if got[k] != base[k] {
					diffs = append(diffs, fmt.Sprintf("%s %s→%s", k, base[k], got[k]))
				}
			}
			t.Logf("with %s alone lifted: %s", ctl.label, strings.Join(diffs, ", "))
		})
	}
}

// hardHostForbids lists the probes whose operation this host forbids
// whatever the container's spec says, and why: their controls cannot show
// anything here.
func hardHostForbids(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	sysctl := func(p string) string {
		b, err := os.ReadFile(p)
		if err != nil {
			return ""
		}
		return strings.TrimSpace(string(b))
	}
	if v := sysctl("/proc/sys/kernel/io_uring_disabled"); v != "" && v != "0" {
		out["io_uring_setup"] = "kernel.io_uring_disabled=" + v
	}
	if v := sysctl("/proc/sys/user/max_user_namespaces"); v == "0" {
		out["clone-newuser"] = "user.max_user_namespaces=0"
	}
	if v := sysctl("/proc/sys/kernel/unprivileged_userns_clone"); v == "0" {
		out["clone-newuser"] = "kernel.unprivileged_userns_clone=0"
	}
	if v := sysctl("/proc/sys/kernel/apparmor_restrict_unprivileged_userns"); v == "1" {
		out["clone-newuser"] = "kernel.apparmor_restrict_unprivileged_userns=1"
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(guest.FreeShortDir(t), &st); err == nil && st.Flags&0x2 != 0 { // ST_NOSUID
		out["setuid-root-exec-euid"] = "the volumes' host file system is mounted nosuid"
	}
	for k, v := range out {
		t.Logf("host restriction: %s is forbidden here regardless of the container (%s)", k, v)
	}
	return out
}

// hardProbeFiles puts in the probe's volume a file of the container's user
// (to chown), a root file (to chmod), a root 0600 file (to read) and a
// setuid-root copy of the probe (to exec).
func hardProbeFiles(t *testing.T, dir, probeBin string, uid, gid int64) {
	t.Helper()
	write := func(name string, mode os.FileMode, owner int) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte("probe file\n"), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(p, owner, owner); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	write("mine", 0o644, int(uid))
	write("rootfile", 0o644, 0)
	write("secret", 0o600, 0)
	suid := filepath.Join(dir, "suid")
	if err := os.Mkdir(suid, 0o755); err != nil {
		t.Fatal(err)
	}
	copyFile(t, probeBin, path.Join(suid, "probe"))
	if err := syscall.Chmod(path.Join(suid, "probe"), 0o4755); err != nil {
		t.Fatal(err)
	}
}

// ---------------------------------------------------------------------------

type hardTimings struct{ lines []string }

func (h *hardTimings) add(what string, since time.Time) {
	h.lines = append(h.lines, fmt.Sprintf("%-62s %7.2fs", what, time.Since(since).Seconds()))
}

func (h *hardTimings) log(t *testing.T) {
	if len(h.lines) > 0 {
		t.Logf("timings:\n  %s", strings.Join(h.lines, "\n  "))
	}
}
