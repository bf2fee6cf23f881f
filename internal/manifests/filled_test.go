package manifests

import (
	"encoding/json"
	"path"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	psa "k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"
	"sigs.k8s.io/yaml"
)

var placeholderRE = regexp.MustCompile(`\$\{[A-Z_]+\}`)

// fill replaces ${NAME} by vals[NAME] as envsubst '$NAME ...' would, and
// fails if a placeholder of doc has no value.
func fill(t *testing.T, doc string, vals map[string]string) string {
	t.Helper()
	out := placeholderRE.ReplaceAllStringFunc(doc, func(p string) string {
		if strings.HasPrefix(strings.TrimSpace(p), "#") {
			return p
		}
		v, ok := vals[p[2:len(p)-1]]
		if !ok {
			return p
		}
		return v
	})
	return out
}

// noPlaceholders fails if a line of doc other than a comment has one left.
func noPlaceholders(t *testing.T, doc string) {
	t.Helper()
	for _, l := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") && placeholderRE.MatchString(l) {
			t.Fatalf("placeholder left after filling: %q", l)
		}
	}
}

// documented returns the placeholders the header comment of doc lists, each
// with a meaning, and checks that the YAML uses no other.
func documented(t *testing.T, doc string) []string {
	t.Helper()
	var listed, used []string
	for _, l := range strings.Split(doc, "\n") {
		if f := strings.Fields(strings.TrimPrefix(l, "#")); strings.HasPrefix(l, "#   ${") && len(f) > 1 {
			listed = append(listed, f[0])
			if Placeholders[f[0]] == "" {
				t.Errorf("%s is listed but has no meaning", f[0])
			}
		} else if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			used = append(used, placeholderRE.FindAllString(l, -1)...)
		}
	}
	for _, u := range used {
		if !slices.Contains(listed, u) {
			t.Errorf("the YAML uses %s, which its header does not document", u)
		}
	}
	for _, l := range listed {
		if !slices.Contains(used, l) {
			t.Errorf("the header lists %s, which the YAML does not use", l)
		}
	}
	return listed
}

// The restore part, filled in the documented way (the digests and names
// from a checkpoint result, QEMU's options as a JSON array), is a valid Pod
// that a namespace enforcing the restricted Pod Security Standard admits,
// with a volume for every mount and every path a container writes.
func TestRestorePodFilledAsDocumented(t *testing.T) {
	o := Options{Image: "vmsnap.test/vmsnap:e2e", RegistryCAConfigMap: "registry-ca", OnRestart: "fail"}
	b, err := RenderParts(o, PartRestore)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	listed := documented(t, doc)
	for _, want := range []string{"${STATE_REPO}", "${STATE_DIGEST}", "${DISK_REPO}", "${DISK_DIGEST}", "${QEMU_IMAGE}", "${QEMU_ARGS}", "${BACKING_FILE}"} {
		if !slices.Contains(listed, want) {
			t.Errorf("the restore part does not list %s", want)
		}
	}
	qemuArgs := []string{"-machine", "pc", "-m", "256", "-nodefaults", "-kernel", "/vm/base/vmlinuz",
		"-qmp", "unix:/vm/run/qmp.sock,server=on,wait=off",
		"-drive", "file=/vm/disk/overlay.qcow2,if=virtio,format=qcow2"}
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
	if pod.Name != "vm-restored" || pod.Namespace != "tenant-a" {
		t.Errorf("pod %s/%s", pod.Namespace, pod.Name)
	}

	// Restricted, by the admission plugin's own checks.
	eval, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		t.Fatal(err)
	}
	res := policy.AggregateCheckResults(eval.EvaluatePod(psa.LevelVersion{Level: psa.LevelRestricted, Version: psa.LatestVersion()}, &pod.ObjectMeta, &pod.Spec))
	if !res.Allowed {
		t.Fatalf("the restored pod is not admissible under restricted: %s", res.ForbiddenDetail())
	}

	vols := map[string]corev1.Volume{}
	for _, v := range pod.Spec.Volumes {
		vols[v.Name] = v
	}
	used := map[string]bool{}
	all := append(append([]corev1.Container(nil), pod.Spec.InitContainers...), pod.Spec.Containers...)
	if names := []string{all[0].Name, all[1].Name, all[2].Name}; len(all) != 3 || !slices.Equal(names, []string{BackingContainerName, RestoreContainerName, "qemu"}) {
		t.Fatalf("containers %q", names)
	}
	for _, c := range all {
		if c.SecurityContext == nil || c.SecurityContext.ReadOnlyRootFilesystem == nil || !*c.SecurityContext.ReadOnlyRootFilesystem {
			t.Errorf("%s: root file system not read-only", c.Name)
		}
		for _, m := range c.VolumeMounts {
			if _, ok := vols[m.Name]; !ok {
				t.Errorf("%s mounts %s, which is not a volume of the pod", c.Name, m.Name)
			}
			used[m.Name] = true
		}
		// Every path it writes is on a writable mount.
		for _, p := range writtenPaths(t, c) {
			if !writableAt(c, p) {
				t.Errorf("%s writes %s, on no writable volume (its root is read-only)", c.Name, p)
			}
		}
	}
	for n := range vols {
		if !used[n] {
			t.Errorf("volume %s is mounted by no container", n)
		}
	}

	backing, restore, qemu := all[0], all[1], all[2]
	if !slices.Equal(backing.Command[len(backing.Command)-2:], []string{"/vm/base/base.qcow2", "/vm/disk/base.qcow2"}) || backing.Image != "vmsnap.test/qemu:e2e" {
		t.Errorf("backing file container %q from %s", backing.Command, backing.Image)
	}
	wantRestore := []string{"vmsnap", "restore", "--image", "10.0.0.5:5000/vms/state@" + d1, "--disk-image", "10.0.0.5:5000/vms/disk@" + d2,
		"--disk", "/vm/disk/overlay.qcow2", "--to-dir", "/vm/state", "--max-bytes", "8589934592", "--marker-dir", "/vm/markers",
		"--ca-file", "/etc/vmsnap/ca/ca.pem"}
	if !slices.Equal(restore.Command, wantRestore) || restore.Image != o.Image || restore.ImagePullPolicy != corev1.PullIfNotPresent {
		t.Errorf("restore init container %q (%s, %s), want %q", restore.Command, restore.Image, restore.ImagePullPolicy, wantRestore)
	}
	ca := vols[VolumeRegistryCA]
	if ca.ConfigMap == nil || ca.ConfigMap.Name != "registry-ca" || mountOfPath(restore, RegistryCADir) == nil {
		t.Errorf("CA volume %+v, mounted at %s: %v", ca, RegistryCADir, mountOfPath(restore, RegistryCADir))
	}
	wantLaunch := []string{"vmsnap", "launch", "--state-dir", "/vm/state", "--qmp", "/vm/run/qmp.sock", "--marker-dir", "/vm/markers",
		"--on-restart", "fail", "--", "qemu-system-x86_64"}
	if !slices.Equal(qemu.Command, wantLaunch) || !slices.Equal(qemu.Args, qemuArgs) {
		t.Errorf("QEMU container command %q args %q, want %q and the source's args", qemu.Command, qemu.Args, wantLaunch)
	}
	if m := mountOfPath(qemu, "/vm/state"); m == nil || !m.ReadOnly {
		t.Errorf("QEMU's state mount %+v: want read-only", m)
	}
	// The markers are shared by the init container and the launcher.
	if restoreM, qemuM := mountOfPath(restore, "/vm/markers"), mountOfPath(qemu, "/vm/markers"); restoreM == nil || qemuM == nil || restoreM.Name != qemuM.Name {
		t.Error("the init container and QEMU do not share the marker volume")
	}
}

// writtenPaths are the paths a container's command line says it writes.
func writtenPaths(t *testing.T, c corev1.Container) []string {
	t.Helper()
	argv := append(append([]string(nil), c.Command...), c.Args...)
	var out []string
	for i, a := range argv {
		if i+1 >= len(argv) {
			break
		}
		next := argv[i+1]
		switch a {
		case "--to-dir", "--marker-dir":
			out = append(out, next+"/x")
		case "--disk":
			out = append(out, next)
		case "-qmp":
			out = append(out, strings.Split(strings.TrimPrefix(next, "unix:"), ",")[0])
		}
	}
	if c.Name == BackingContainerName {
		out = append(out, argv[len(argv)-1], argv[len(argv)-1]+".vmsnap-tmp")
	}
	if c.Name == "qemu" {
		// vmsnap launch's marker, and the overlay QEMU writes to.
		out = append(out, "/vm/markers/loaded-sha256-x", "/vm/disk/overlay.qcow2")
	}
	if len(out) == 0 {
		t.Fatalf("%s: found no written path in %q", c.Name, argv)
	}
	return out
}

func writableAt(c corev1.Container, p string) bool {
	m := mountOfPath(c, path.Dir(p))
	return m != nil && !m.ReadOnly
}

// mountOfPath is the mount p is on (the longest mount path holding it).
func mountOfPath(c corev1.Container, p string) *corev1.VolumeMount {
	var best *corev1.VolumeMount
	for i, m := range c.VolumeMounts {
		if within(p, m.MountPath) && (best == nil || len(m.MountPath) > len(best.MountPath)) {
			best = &c.VolumeMounts[i]
		}
	}
	return best
}

// The Job template filled the documented way pushes to tagged references of
// the same repositories the restore pulls by digest, runs in the agent's
// namespace, labelled privileged for enforce, warn and audit, which the
// agent lists as an admin namespace; and privileged is needed: the hostPath
// is the one thing restricted (and baseline) refuse in it.
func TestJobTemplateFilledAsDocumented(t *testing.T) {
	o := Options{}
	b, err := RenderParts(o, PartAgent, PartJob)
	if err != nil {
		t.Fatal(err)
	}
	docs := splitDocs(t, b)
	jobDoc := docs[len(docs)-1]
	documented(t, jobDoc)
	filled := fill(t, jobDoc, map[string]string{
		"NODE_NAME": "node-1", "SOURCE_POD_UID": "0b1c8e0e-8a7e-4c3e-9d55-2f0c6a7e1f00", "QEMU_CONTAINER": "qemu",
		"QMP_SOCKET": "/vm/run/qmp.sock", "DISK_PATH": "/vm/disk/overlay.qcow2",
		"STATE_REPO": "10.0.0.5:5000/vms/state", "DISK_REPO": "10.0.0.5:5000/vms/disk", "TAG": "ckpt-1",
	})
	noPlaceholders(t, filled)
	var job struct {
		metav1.TypeMeta   `json:",inline"`
		metav1.ObjectMeta `json:"metadata"`
		Spec              struct {
			Template corev1.PodTemplateSpec `json:"template"`
		} `json:"spec"`
	}
	if err := yamlUnmarshal(filled, &job); err != nil {
		t.Fatal(err)
	}
	cmd := strings.Join(job.Spec.Template.Spec.Containers[0].Command, " ")
	if !strings.Contains(cmd, "--image 10.0.0.5:5000/vms/state:ckpt-1") || !strings.Contains(cmd, "--disk-image 10.0.0.5:5000/vms/disk:ckpt-1") {
		t.Errorf("job command %q", cmd)
	}
	ns := Namespace(o)
	for _, mode := range []string{"enforce", "warn", "audit"} {
		if ns.Labels["pod-security.kubernetes.io/"+mode] != "privileged" {
			t.Errorf("namespace label %s=%q, want privileged: every Job would be warned about", mode, ns.Labels["pod-security.kubernetes.io/"+mode])
		}
	}
	if job.Namespace != ns.Name || AdminNamespaces(o)[0] != ns.Name {
		t.Errorf("job in %q, namespace %q, admin namespaces %q", job.Namespace, ns.Name, AdminNamespaces(o))
	}
	eval, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for level, reason := range map[psa.Level]string{psa.LevelBaseline: "hostPath volumes", psa.LevelRestricted: "restricted volume types"} {
		var forbidden []string
		for _, r := range eval.EvaluatePod(psa.LevelVersion{Level: level, Version: psa.LatestVersion()}, &job.Spec.Template.ObjectMeta, &job.Spec.Template.Spec) {
			if !r.Allowed {
				forbidden = append(forbidden, r.ForbiddenReason+": "+r.ForbiddenDetail)
			}
		}
		if len(forbidden) != 1 || !strings.HasPrefix(forbidden[0], reason+": ") || !strings.Contains(forbidden[0], "agent-socket") {
			t.Errorf("%s refuses the Job for %q; want its hostPath agent-socket alone", level, forbidden)
		}
	}
}

// The agent's policy flags and node paths are options, passed through.
func TestAgentOptionsPassedThrough(t *testing.T) {
	o := Options{
		AllowRepositories: []string{"10.0.0.5:5000/vms", "reg.example/tenant-a"}, AdminNamespaces: []string{"vm-ctl", DefaultNamespace},
		LayoutRoot: "/srv/vmsnap-layouts", OperationTimeout: 20 * time.Minute, MaxWorkers: 6, RAMCacheMaxBytes: 1 << 30, RegistryCAConfigMap: "registry-ca",
		ContainerdSocket: "/var/snap/microk8s/common/run/containerd.sock", ContainerdRoot: "/var/snap/microk8s/common/var/lib/containerd",
		KubeletPodsDir: "/var/snap/microk8s/common/var/lib/kubelet/pods",
	}
	r := render(t, o)
	c := r.ds.Spec.Template.Spec.Containers[0]
	want := []string{"vmsnap", "agent", "--socket", "/run/vmsnap/agent.sock", "--state-dir", "/var/lib/vmsnap",
		"--containerd-address", "/var/snap/microk8s/common/run/containerd.sock",
		"--allow-repository", "10.0.0.5:5000/vms", "--allow-repository", "reg.example/tenant-a",
		"--admin-namespace", "vmsnap-system", "--admin-namespace", "vm-ctl",
		"--layout-root", "/srv/vmsnap-layouts", "--kubelet-pods-dir", "/var/snap/microk8s/common/var/lib/kubelet/pods",
		"--operation-timeout", "20m0s", "--max-workers", "6", "--ram-cache-max-bytes", "1073741824",
		"--ca-file", "/etc/vmsnap/ca/ca.pem"}
	if !slices.Equal(c.Command, want) {
		t.Errorf("agent command\n%q, want\n%q", c.Command, want)
	}
	hp := hostPaths(r.ds.Spec.Template.Spec)
	for _, p := range []string{o.ContainerdSocket, o.ContainerdRoot, o.KubeletPodsDir, o.LayoutRoot} {
		if hp[p] == "" || mountOfPath(c, p) == nil || mountOfPath(c, p).MountPath != p {
			t.Errorf("host path %s: %q, mounted %+v", p, hp[p], mountOfPath(c, p))
		}
	}
	if m := mountOfPath(c, RegistryCADir); m == nil || !m.ReadOnly {
		t.Errorf("CA mount %+v", m)
	}
	doc := r.doc(t, "DaemonSet")
	for _, line := range []string{"- 10.0.0.5:5000/vms", "- vmsnap-system", "path: /srv/vmsnap-layouts", "- configMap:"} {
		commentAbove(t, doc, line)
	}
	// With no --allow-repository the header says every registry is refused.
	if d := render(t, Options{}).doc(t, "DaemonSet"); !strings.Contains(d, "refuses every registry target") {
		t.Error("the agent's header does not warn that no registry is allowed")
	}
}

func yamlUnmarshal(doc string, out any) error { return yaml.Unmarshal([]byte(doc), out) }

// The restored pod for a restore through the agent: the disk alone before
// QEMU starts, QEMU waiting with vmsnap launch --defer, still restricted.
func TestRestorePodViaAgentFilledAsDocumented(t *testing.T) {
	b, err := RenderParts(Options{RestoreViaAgent: true}, PartRestore)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	listed := documented(t, doc)
	if slices.Contains(listed, "${STATE_REPO}") || slices.Contains(listed, "${STATE_DIGEST}") {
		t.Errorf("a restore through the agent lists the state's placeholders: %q", listed)
	}
	filled := fill(t, doc, map[string]string{
		"POD_NAME": "vm-restored", "NAMESPACE": "tenant-a", "QEMU_IMAGE": "vmsnap.test/qemu:e2e", "BACKING_FILE": "base.qcow2",
		"DISK_REPO": "10.0.0.5:5000/vms/disk", "DISK_DIGEST": "sha256:" + strings.Repeat("2", 64),
		"QEMU_ARGS": `["-machine","pc","-qmp","unix:/vm/run/qmp.sock,server=on,wait=off"]`,
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
	restore, qemu := pod.Spec.InitContainers[1], pod.Spec.Containers[0]
	if cmd := strings.Join(restore.Command, " "); strings.Contains(cmd, "--image") || strings.Contains(cmd, "--to-dir") || !strings.Contains(cmd, "--marker-dir /vm/markers") {
		t.Errorf("restore init container %q: want the disk alone, once per pod", cmd)
	}
	want := []string{"vmsnap", "launch", "--defer", "--marker-dir", "/vm/markers", "--on-restart", "cold", "--", "qemu-system-x86_64"}
	if !slices.Equal(qemu.Command, want) || mountOfPath(qemu, "/vm/state") != nil {
		t.Errorf("QEMU %q with mounts %+v; want %q and no state volume", qemu.Command, qemu.VolumeMounts, want)
	}
	for _, v := range pod.Spec.Volumes {
		if v.Name == DefaultRestoreStateVolume {
			t.Error("a restore through the agent has a state volume")
		}
	}
}
