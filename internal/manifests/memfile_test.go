package manifests

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	psa "k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"
)

// A memory-file snapshot's restored pod, filled the documented way: the
// restore init container stages the state, vmsnap-prepare materializes the
// RAM file into the pod's own emptyDir with medium: Memory and records the
// QEMU arguments in the state directory, and QEMU, started by vmsnap
// launch, mounts that volume at the same path. No hostPath, nothing shared
// with another pod, restricted admits it.
func TestRestorePodMemoryFileFilledAsDocumented(t *testing.T) {
	o := Options{Image: "vmsnap.test/vmsnap:e2e", RegistryCAConfigMap: "registry-ca", MemoryFile: true, RestoreRAMSizeLimit: resource.MustParse("2Gi")}
	b, err := RenderParts(o, PartRestore)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	documented(t, doc)
	for _, want := range []string{"Four containers", "vmsnap-prepare materializes", "medium: Memory", "never shared", "-incoming defer", "/vm/state/prepared.json"} {
		if !strings.Contains(doc, want) {
			t.Errorf("the restore part does not say %q", want)
		}
	}
	qemuArgs := []string{"-machine", "pc", "-m", "256", "-qmp", "unix:/vm/run/qmp.sock,server=on,wait=off", "-drive", "file=/vm/disk/overlay.qcow2,if=virtio,format=qcow2"}
	argsJSON, _ := json.Marshal(qemuArgs)
	d1, d2 := "sha256:"+strings.Repeat("1", 64), "sha256:"+strings.Repeat("2", 64)
	filled := fill(t, doc, map[string]string{
		"POD_NAME": "vm-restored", "NAMESPACE": "tenant-a", "QEMU_IMAGE": "vmsnap.test/qemu:e2e", "BACKING_FILE": "base.qcow2",
		"STATE_REPO": "10.0.0.5:5000/vms/state", "STATE_DIGEST": d1, "DISK_REPO": "10.0.0.5:5000/vms/disk", "DISK_DIGEST": d2,
		"QEMU_ARGS": string(argsJSON),
	})
	noPlaceholders(t, filled)
	var pod corev1.Pod
	strictDecode(t, filled, &pod)
	eval, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if res := policy.AggregateCheckResults(eval.EvaluatePod(psa.LevelVersion{Level: psa.LevelRestricted, Version: psa.LatestVersion()}, &pod.ObjectMeta, &pod.Spec)); !res.Allowed {
		t.Fatalf("not admissible under restricted: %s", res.ForbiddenDetail())
	}
	all := append(append([]corev1.Container(nil), pod.Spec.InitContainers...), pod.Spec.Containers...)
	var names []string
	for _, c := range all {
		names = append(names, c.Name)
	}
	if !slices.Equal(names, []string{BackingContainerName, RestoreContainerName, PrepareContainerName, "qemu"}) {
		t.Fatalf("containers %q: want the prepare after the restore (it needs the staged state), before QEMU", names)
	}
	restore, prepare, qemu := all[1], all[2], all[3]
	wantPrepare := []string{"vmsnap", "prepare", "10.0.0.5:5000/vms/state@" + d1, "--cache-dir", "/vm/ram/cache", "--private-volume", "--state-dir", "/vm/state", "--json",
		"--ca-file", "/etc/vmsnap/ca/ca.pem"}
	if !slices.Equal(prepare.Command, wantPrepare) || prepare.Image != o.Image {
		t.Errorf("prepare init container %q (%s), want %q", prepare.Command, prepare.Image, wantPrepare)
	}
	if !strings.Contains(strings.Join(restore.Command, " "), "--to-dir /vm/state") {
		t.Errorf("the restore init container does not stage the state: %q", restore.Command)
	}
	// The prepare writes the RAM file and the record; QEMU maps the file
	// at the same path, writable (QEMU 7.2 opens it read-write), and
	// reads the record from the read-only state mount.
	for _, p := range []string{"/vm/ram/cache/sha256-x.ram", "/vm/state/prepared.json"} {
		if !writableAt(prepare, p) {
			t.Errorf("vmsnap-prepare writes %s, on no writable volume", p)
		}
	}
	pm, qm := mountOfPath(prepare, "/vm/ram/cache"), mountOfPath(qemu, "/vm/ram/cache")
	if pm == nil || qm == nil || pm.Name != qm.Name || pm.MountPath != qm.MountPath || qm.ReadOnly {
		t.Errorf("RAM volume mounts: prepare %+v, qemu %+v; want one volume at one path, writable in QEMU", pm, qm)
	}
	if m := mountOfPath(qemu, "/vm/state"); m == nil || !m.ReadOnly {
		t.Errorf("QEMU's state mount %+v: want read-only", m)
	}
	if mountOfPath(prepare, RegistryConfigDir) == nil || mountOfPath(prepare, RegistryCADir) == nil {
		t.Error("vmsnap-prepare lacks the registry credentials or CA")
	}
	wantLaunch := []string{"vmsnap", "launch", "--state-dir", "/vm/state", "--qmp", "/vm/run/qmp.sock", "--marker-dir", "/vm/markers", "--on-restart", "cold", "--", "qemu-system-x86_64"}
	if !slices.Equal(qemu.Command, wantLaunch) {
		t.Errorf("QEMU %q, want %q", qemu.Command, wantLaunch)
	}
	var ram *corev1.Volume
	for i, v := range pod.Spec.Volumes {
		if v.HostPath != nil {
			t.Errorf("volume %s is a hostPath", v.Name)
		}
		if v.Name == DefaultRestoreRAMVolume {
			ram = &pod.Spec.Volumes[i]
		}
	}
	if ram == nil || ram.EmptyDir == nil || ram.EmptyDir.Medium != corev1.StorageMediumMemory || ram.EmptyDir.SizeLimit == nil || ram.EmptyDir.SizeLimit.String() != "2Gi" {
		t.Fatalf("RAM volume %+v: want an emptyDir with medium: Memory, sizeLimit 2Gi", ram)
	}
	// The tmpfs pages the prepare writes are charged to it.
	if lim := prepare.Resources.Limits[corev1.ResourceMemory]; lim.Cmp(resource.MustParse("2Gi")) <= 0 {
		t.Errorf("vmsnap-prepare's memory limit %s does not hold the 2Gi RAM file", lim.String())
	}
	for _, c := range all {
		if c.SecurityContext == nil || c.SecurityContext.ReadOnlyRootFilesystem == nil || !*c.SecurityContext.ReadOnlyRootFilesystem ||
			c.SecurityContext.RunAsUser == nil || *c.SecurityContext.RunAsUser != DefaultNonRootUser {
			t.Errorf("%s: want non-root %d with a read-only root", c.Name, DefaultNonRootUser)
		}
	}

	// Without MemoryFile: no prepare, no RAM volume.
	plain := RestorePod(Options{})
	for _, c := range plain.Spec.InitContainers {
		if c.Name == PrepareContainerName {
			t.Error("a plain restore has a prepare init container")
		}
	}
	for _, v := range plain.Spec.Volumes {
		if v.Name == DefaultRestoreRAMVolume {
			t.Error("a plain restore has a RAM volume")
		}
	}
	// The default limits (the state's and the RAM's both 8Gi) render.
	if _, err := RenderParts(Options{MemoryFile: true}, PartRestore); err != nil {
		t.Errorf("default limits: %v", err)
	}
}

func TestValidateMemoryFile(t *testing.T) {
	for _, tc := range []struct {
		o    Options
		says string
	}{
		{Options{MemoryFile: true, RestoreViaAgent: true}, "MemoryFile with RestoreViaAgent"},
		{Options{MemoryFile: true, RestoreRAMDir: "/vm/state/ram"}, "overlap"},
		{Options{MemoryFile: true, RestoreRAMDir: "vm/ram"}, "RestoreRAMDir"},
		{Options{MemoryFile: true, RestoreRAMVolume: DefaultRestoreStateVolume}, "used twice"},
		{Options{MemoryFile: true, RestoreRAMSizeLimit: resource.MustParse("-1Gi")}, "RestoreRAMSizeLimit"},
	} {
		if err := tc.o.Validate(); err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%+v: %v; want an error saying %q", tc.o, err, tc.says)
		}
	}
}
