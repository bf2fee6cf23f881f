package manifests

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"reflect"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/yaml"
)

// rendered is Render's output split into documents and decoded strictly.
type rendered struct {
	docs []string // the YAML text of each document, comments included
	ns   *corev1.Namespace
	sa   *corev1.ServiceAccount
	ds   *appsv1.DaemonSet
	job  *batchv1.Job
	pod  *corev1.Pod
}

// strictDecode decodes one YAML document into out twice, both ways strict:
// sigs.k8s.io/yaml's UnmarshalStrict, and YAMLToJSONStrict (duplicate keys
// are errors) followed by a JSON decoder that rejects unknown fields.
func strictDecode(t *testing.T, doc string, out any) {
	t.Helper()
	if err := yaml.UnmarshalStrict([]byte(doc), out); err != nil {
		t.Fatalf("UnmarshalStrict into %T: %v\n%s", out, err, doc)
	}
	j, err := yaml.YAMLToJSONStrict([]byte(doc))
	if err != nil {
		t.Fatalf("YAMLToJSONStrict: %v\n%s", err, doc)
	}
	again := reflect.New(reflect.TypeOf(out).Elem()).Interface()
	dec := json.NewDecoder(bytes.NewReader(j))
	dec.DisallowUnknownFields()
	if err := dec.Decode(again); err != nil {
		t.Fatalf("decoding into %T with DisallowUnknownFields: %v\n%s", out, err, j)
	}
	if _, err := dec.Token(); err != io.EOF {
		t.Fatalf("trailing data after the %T", out)
	}
	if !equality.Semantic.DeepEqual(out, again) {
		t.Fatalf("the two strict decodings of the %T differ", out)
	}
}

func splitDocs(t *testing.T, b []byte) []string {
	t.Helper()
	if !bytes.HasSuffix(b, []byte("\n")) {
		t.Fatal("output does not end with a newline")
	}
	return strings.Split(string(b), "\n---\n")
}

func render(t *testing.T, o Options) rendered {
	t.Helper()
	b, err := Render(o)
	if err != nil {
		t.Fatal(err)
	}
	r := rendered{docs: splitDocs(t, b)}
	var kinds []string
	for _, d := range r.docs {
		var tm struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
		}
		if err := yaml.Unmarshal([]byte(d), &tm); err != nil {
			t.Fatal(err)
		}
		kinds = append(kinds, tm.APIVersion+" "+tm.Kind)
		switch tm.Kind {
		case "Namespace":
			r.ns = new(corev1.Namespace)
			strictDecode(t, d, r.ns)
		case "ServiceAccount":
			r.sa = new(corev1.ServiceAccount)
			strictDecode(t, d, r.sa)
		case "DaemonSet":
			r.ds = new(appsv1.DaemonSet)
			strictDecode(t, d, r.ds)
		case "Job":
			r.job = new(batchv1.Job)
			strictDecode(t, d, r.job)
		case "Pod":
			// The one placeholder that is not a string: fill it with
			// itself, as a JSON array, to get RestorePod back.
			r.pod = new(corev1.Pod)
			strictDecode(t, fill(t, d, map[string]string{"QEMU_ARGS": `["${QEMU_ARGS}"]`}), r.pod)
		default:
			t.Fatalf("unexpected document %q:\n%s", tm.APIVersion+" "+tm.Kind, d)
		}
	}
	want := []string{"v1 Namespace", "v1 ServiceAccount", "apps/v1 DaemonSet", "batch/v1 Job", "v1 Pod"}
	if o.OmitNamespace {
		want = want[1:]
	}
	if !slices.Equal(kinds, want) {
		t.Fatalf("documents %q, want %q", kinds, want)
	}
	return r
}

func (r rendered) doc(t *testing.T, kind string) string {
	t.Helper()
	for _, d := range r.docs {
		if strings.Contains(d, "\nkind: "+kind+"\n") {
			return d
		}
	}
	t.Fatalf("no %s document", kind)
	return ""
}

// commentAbove returns the comment lines just above the one line of doc
// whose trimmed text is line, failing unless there is exactly one such line.
func commentAbove(t *testing.T, doc, line string) string {
	t.Helper()
	lines := strings.Split(doc, "\n")
	at := -1
	for i, l := range lines {
		if strings.TrimSpace(l) == line {
			if at >= 0 {
				t.Fatalf("%q appears twice", line)
			}
			at = i
		}
	}
	if at < 0 {
		t.Fatalf("no line %q in\n%s", line, doc)
	}
	var c []string
	for i := at - 1; i >= 0 && strings.HasPrefix(strings.TrimSpace(lines[i]), "#"); i-- {
		c = append([]string{strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(lines[i]), "#"))}, c...)
	}
	why := strings.Join(c, " ")
	if len(why) < 15 {
		t.Errorf("no comment explains %q (got %q)", line, why)
	}
	return why
}

func hostPaths(spec corev1.PodSpec) map[string]corev1.HostPathType {
	m := map[string]corev1.HostPathType{}
	for _, v := range spec.Volumes {
		if v.HostPath != nil {
			m[v.HostPath.Path] = *v.HostPath.Type
		}
	}
	return m
}

func mountOf(t *testing.T, c corev1.Container, volume string) corev1.VolumeMount {
	t.Helper()
	for _, m := range c.VolumeMounts {
		if m.Name == volume {
			return m
		}
	}
	t.Fatalf("container %s does not mount %s", c.Name, volume)
	return corev1.VolumeMount{}
}

func volumeOf(t *testing.T, spec corev1.PodSpec, name string) corev1.Volume {
	t.Helper()
	for _, v := range spec.Volumes {
		if v.Name == name {
			return v
		}
	}
	t.Fatalf("no volume %s", name)
	return corev1.Volume{}
}

// checkHardened asserts the container hardening every vmsnap container has,
// whether it runs as root (the agent) or not.
func checkHardened(t *testing.T, what string, pod *corev1.PodSecurityContext, c corev1.Container, wantAdd []corev1.Capability) {
	t.Helper()
	sc := c.SecurityContext
	if sc == nil {
		t.Fatalf("%s: no securityContext", what)
	}
	if sc.Privileged == nil || *sc.Privileged {
		t.Errorf("%s: privileged is not false", what)
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		t.Errorf("%s: allowPrivilegeEscalation is not false", what)
	}
	if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Errorf("%s: readOnlyRootFilesystem is not true", what)
	}
	if sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("%s: container seccompProfile is not RuntimeDefault", what)
	}
	if pod != nil && (pod.SeccompProfile == nil || pod.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault) {
		t.Errorf("%s: pod seccompProfile is not RuntimeDefault", what)
	}
	if sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("%s: capabilities do not drop ALL: %+v", what, sc.Capabilities)
	} else if !slices.Equal(sc.Capabilities.Add, wantAdd) {
		t.Errorf("%s: capabilities add %q, want %q", what, sc.Capabilities.Add, wantAdd)
	}
	if sc.ProcMount != nil || sc.WindowsOptions != nil || sc.SELinuxOptions != nil || sc.AppArmorProfile != nil {
		t.Errorf("%s: unexpected securityContext fields: %+v", what, sc)
	}
	for _, res := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory, corev1.ResourceEphemeralStorage} {
		req, okReq := c.Resources.Requests[res]
		lim, okLim := c.Resources.Limits[res]
		if !okReq || !okLim {
			t.Errorf("%s: %s request or limit missing: %+v", what, res, c.Resources)
			continue
		}
		if req.Sign() <= 0 || lim.Cmp(req) < 0 {
			t.Errorf("%s: %s request %s, limit %s", what, res, req.String(), lim.String())
		}
	}
}

func checkNonRoot(t *testing.T, what string, c corev1.Container) {
	t.Helper()
	sc := c.SecurityContext
	if sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot {
		t.Errorf("%s: runAsNonRoot is not true", what)
	}
	if sc.RunAsUser == nil || *sc.RunAsUser == 0 || sc.RunAsGroup == nil || *sc.RunAsGroup == 0 {
		t.Errorf("%s: runs as user %v group %v, want non-root", what, sc.RunAsUser, sc.RunAsGroup)
	}
}

func checkNoHostNamespaces(t *testing.T, what string, spec corev1.PodSpec) {
	t.Helper()
	if spec.HostNetwork || spec.HostPID || spec.HostIPC {
		t.Errorf("%s: shares a host namespace", what)
	}
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Errorf("%s: mounts a service account token", what)
	}
}

// checkRegistrySecret asserts the dockerconfigjson pattern: the secret's
// .dockerconfigjson as config.json, mounted read-only, DOCKER_CONFIG set.
func checkRegistrySecret(t *testing.T, what string, spec corev1.PodSpec, c corev1.Container, secret string, mode int32) {
	t.Helper()
	v := volumeOf(t, spec, VolumeRegistry)
	if v.Secret == nil || v.Secret.SecretName != secret {
		t.Fatalf("%s: registry volume is not secret %s: %+v", what, secret, v)
	}
	if want := []corev1.KeyToPath{{Key: ".dockerconfigjson", Path: "config.json"}}; !reflect.DeepEqual(v.Secret.Items, want) {
		t.Errorf("%s: secret items %+v, want %+v", what, v.Secret.Items, want)
	}
	if v.Secret.DefaultMode == nil {
		t.Errorf("%s: secret has no defaultMode", what)
	} else if *v.Secret.DefaultMode != mode {
		t.Errorf("%s: secret mode %o, want %o", what, *v.Secret.DefaultMode, mode)
	}
	m := mountOf(t, c, VolumeRegistry)
	if !m.ReadOnly || m.MountPath != RegistryConfigDir {
		t.Errorf("%s: registry secret mount %+v, want read-only at %s", what, m, RegistryConfigDir)
	}
	if !slices.Contains(c.Env, corev1.EnvVar{Name: "DOCKER_CONFIG", Value: RegistryConfigDir}) {
		t.Errorf("%s: DOCKER_CONFIG is not %s: %+v", what, RegistryConfigDir, c.Env)
	}
}

func TestRenderDecodesStrictlyAndMatchesTheTypes(t *testing.T) {
	o := Options{}
	r := render(t, o)
	for _, c := range []struct {
		got, want any
	}{
		{r.ns, Namespace(o)}, {r.sa, ServiceAccount(o)}, {r.ds, DaemonSet(o)},
		{r.job, JobTemplate(o)}, {r.pod, RestorePod(o)},
	} {
		// Comments and dropping the status change nothing of the object.
		if !equality.Semantic.DeepEqual(c.got, c.want) {
			t.Errorf("the rendered %T differs from the constructed one", c.want)
		}
	}
	for i, d := range r.docs {
		if !strings.HasPrefix(d, "# ") {
			t.Errorf("document %d has no header comment", i)
		}
		if strings.Contains(d, "\nstatus:") {
			t.Errorf("document %d has a status", i)
		}
	}
	all := strings.Join(r.docs, "\n")
	if strings.Count(all, "hostPID: true") != 1 || !strings.Contains(r.doc(t, "DaemonSet"), "hostPID: true") {
		t.Error("hostPID is not the agent's alone")
	}
	for _, bad := range []string{"privileged: true", "hostNetwork: true", "hostIPC: true",
		"allowPrivilegeEscalation: true", "readOnlyRootFilesystem: false", "SYS_ADMIN\n"} {
		if strings.Contains(all, bad) {
			t.Errorf("output contains %q", bad)
		}
	}
}

func TestAgentDaemonSet(t *testing.T) {
	o := Options{}
	r := render(t, o)
	ds, doc := r.ds, r.doc(t, "DaemonSet")
	spec := ds.Spec.Template.Spec

	if ds.Namespace != DefaultNamespace || ds.Name != "vmsnap-agent" {
		t.Errorf("DaemonSet %s/%s", ds.Namespace, ds.Name)
	}
	if !reflect.DeepEqual(spec.NodeSelector, map[string]string{"vmsnap.dev/kvm": "true"}) {
		t.Errorf("nodeSelector %v", spec.NodeSelector)
	}
	if !equality.Semantic.DeepEqual(ds.Spec.Selector.MatchLabels, ds.Spec.Template.Labels) {
		t.Errorf("selector %v does not match the template's labels %v", ds.Spec.Selector.MatchLabels, ds.Spec.Template.Labels)
	}
	if spec.HostNetwork || spec.HostIPC || !spec.HostPID {
		t.Errorf("agent: host network %v, IPC %v, PID %v; want the host PID namespace only", spec.HostNetwork, spec.HostIPC, spec.HostPID)
	}
	commentAbove(t, doc, "hostPID: true")
	if spec.ServiceAccountName != r.sa.Name || r.sa.AutomountServiceAccountToken == nil || *r.sa.AutomountServiceAccountToken {
		t.Errorf("service account %q (token %v)", spec.ServiceAccountName, r.sa.AutomountServiceAccountToken)
	}
	if len(spec.Containers) != 1 || len(spec.InitContainers) != 0 {
		t.Fatalf("%d containers, %d init containers", len(spec.Containers), len(spec.InitContainers))
	}
	c := spec.Containers[0]
	if want := []string{"vmsnap", "agent", "--socket", "/run/vmsnap/agent.sock", "--state-dir", "/var/lib/vmsnap",
		"--containerd-address", "/run/containerd/containerd.sock", "--admin-namespace", "vmsnap-system"}; !slices.Equal(c.Command, want) {
		t.Errorf("command %q, want %q", c.Command, want)
	}

	// Root, not privileged, one capability: the justified minimal set.
	checkHardened(t, "agent", spec.SecurityContext, c, []corev1.Capability{"DAC_OVERRIDE"})
	if sc := c.SecurityContext; sc.RunAsUser == nil || *sc.RunAsUser != 0 || sc.RunAsNonRoot == nil || *sc.RunAsNonRoot {
		t.Errorf("agent: runAsUser %v runAsNonRoot %v, want 0 and false", sc.RunAsUser, sc.RunAsNonRoot)
	}
	if sc := c.SecurityContext; sc.RunAsGroup == nil || *sc.RunAsGroup != DefaultSocketGroup {
		t.Errorf("agent: runAsGroup %v, want the socket group %d", sc.RunAsGroup, DefaultSocketGroup)
	}
	for _, line := range []string{"runAsUser: 0", "- DAC_OVERRIDE", "- ALL", "privileged: false",
		"allowPrivilegeEscalation: false", "readOnlyRootFilesystem: true", "runAsGroup: 2375"} {
		commentAbove(t, doc, line)
	}
	if why := commentAbove(t, doc, "- DAC_OVERRIDE"); !strings.Contains(why, "connect") {
		t.Errorf("the DAC_OVERRIDE comment does not say what it is for: %q", why)
	}

	// Exactly the documented host paths, each at its own path, each explained.
	wantHost := map[string]corev1.HostPathType{
		"/run/containerd/containerd.sock": corev1.HostPathSocket,
		"/var/lib/kubelet/pods":           corev1.HostPathDirectory,
		"/var/lib/containerd":             corev1.HostPathDirectory,
		"/run/vmsnap":                     corev1.HostPathDirectoryOrCreate,
		"/var/lib/vmsnap":                 corev1.HostPathDirectoryOrCreate,
	}
	if got := hostPaths(spec); !reflect.DeepEqual(got, wantHost) {
		t.Errorf("host paths %v, want %v", got, wantHost)
	}
	for _, v := range spec.Volumes {
		switch {
		case v.HostPath != nil:
			m := mountOf(t, c, v.Name)
			if m.MountPath != v.HostPath.Path {
				t.Errorf("host path %s mounted at %s", v.HostPath.Path, m.MountPath)
			}
			commentAbove(t, doc, "path: "+v.HostPath.Path)
			if !strings.Contains(strings.SplitN(doc, "\napiVersion:", 2)[0], v.HostPath.Path) {
				t.Errorf("the header does not list %s", v.HostPath.Path)
			}
		case v.Secret != nil:
		default:
			t.Errorf("unexpected volume %+v", v)
		}
	}
	pods := mountOf(t, c, "kubelet-pods")
	if !pods.ReadOnly || pods.MountPropagation == nil || *pods.MountPropagation != corev1.MountPropagationHostToContainer {
		t.Errorf("kubelet pods mount %+v, want read-only with HostToContainer", pods)
	}
	commentAbove(t, doc, "mountPropagation: HostToContainer")
	if root := mountOf(t, c, "containerd-root"); !root.ReadOnly {
		t.Errorf("containerd root mount %+v, want read-only", root)
	}
	for _, name := range []string{"containerd-socket", "containerd-root", "agent-socket", "agent-state"} {
		if m := mountOf(t, c, name); m.MountPropagation != nil {
			t.Errorf("%s has mount propagation %v", name, *m.MountPropagation)
		}
	}

	checkRegistrySecret(t, "agent", spec, c, DefaultPullSecret, 0o400)
	commentAbove(t, doc, "secretName: "+DefaultPullSecret)

	health := []string{"vmsnap", "agent", "health", "--socket", "/run/vmsnap/agent.sock"}
	for name, p := range map[string]*corev1.Probe{"liveness": c.LivenessProbe, "readiness": c.ReadinessProbe, "startup": c.StartupProbe} {
		if p == nil || p.Exec == nil || !slices.Equal(p.Exec.Command, health) || p.TimeoutSeconds == 0 {
			t.Errorf("%s probe %+v, want exec %q", name, p, health)
		}
	}
	if !strings.Contains(doc, "vmsnap agent health --socket PATH") {
		t.Error("the header does not document the health command")
	}
}

func TestCheckpointJob(t *testing.T) {
	o := Options{}
	r := render(t, o)
	job, doc := r.job, r.doc(t, "Job")
	spec := job.Spec.Template.Spec

	if job.Spec.BackoffLimit == nil || *job.Spec.BackoffLimit != 0 {
		t.Errorf("backoffLimit %v, want 0", job.Spec.BackoffLimit)
	}
	if d := job.Spec.ActiveDeadlineSeconds; d == nil || *d != DefaultJobActiveDeadlineSeconds {
		t.Errorf("activeDeadlineSeconds %v", d)
	}
	if ttl := job.Spec.TTLSecondsAfterFinished; ttl == nil || *ttl != DefaultJobTTLSecondsAfterFinish {
		t.Errorf("ttlSecondsAfterFinished %v", ttl)
	}
	if spec.RestartPolicy != corev1.RestartPolicyNever || spec.NodeName != "${NODE_NAME}" {
		t.Errorf("restartPolicy %q nodeName %q", spec.RestartPolicy, spec.NodeName)
	}
	checkNoHostNamespaces(t, "job", spec)
	if len(spec.Containers) != 1 || len(spec.InitContainers) != 0 {
		t.Fatalf("%d containers", len(spec.Containers))
	}
	c := spec.Containers[0]
	checkHardened(t, "job", spec.SecurityContext, c, nil)
	checkNonRoot(t, "job", c)
	if !slices.Contains(spec.SecurityContext.SupplementalGroups, DefaultSocketGroup) {
		t.Errorf("supplementalGroups %v lack the socket group", spec.SecurityContext.SupplementalGroups)
	}
	if c.TerminationMessagePolicy != corev1.TerminationMessageReadFile || c.TerminationMessagePath != "/dev/termination-log" {
		t.Errorf("termination message %q %q", c.TerminationMessagePolicy, c.TerminationMessagePath)
	}
	if !slices.Contains(c.Env, corev1.EnvVar{Name: "SOURCE_POD_UID", Value: "${SOURCE_POD_UID}"}) {
		t.Errorf("env %+v lacks SOURCE_POD_UID", c.Env)
	}
	want := []string{"vmsnap", "checkpoint", "--agent", "unix:///run/vmsnap/agent.sock", "--json",
		"--termination-log", "/dev/termination-log", "--pod-uid", "$(SOURCE_POD_UID)",
		"--container", "${QEMU_CONTAINER}", "--qmp", "${QMP_SOCKET}", "--image", "${STATE_REPO}:${TAG}",
		"--disk", "${DISK_PATH}", "--disk-image", "${DISK_REPO}:${TAG}", "--mode", "pause"}
	if !slices.Equal(c.Command, want) {
		t.Errorf("command\n%q, want\n%q", c.Command, want)
	}

	// Only the agent's socket directory, read-only; no secret, nothing else.
	if got, want := hostPaths(spec), map[string]corev1.HostPathType{"/run/vmsnap": corev1.HostPathDirectory}; !reflect.DeepEqual(got, want) {
		t.Errorf("host paths %v, want %v", got, want)
	}
	if len(spec.Volumes) != 1 || len(c.VolumeMounts) != 1 {
		t.Errorf("volumes %+v mounts %+v", spec.Volumes, c.VolumeMounts)
	}
	if m := mountOf(t, c, "agent-socket"); !m.ReadOnly || m.MountPath != "/run/vmsnap" {
		t.Errorf("socket mount %+v", m)
	}
	for _, line := range []string{"path: /run/vmsnap", "supplementalGroups:", "backoffLimit: 0",
		"terminationMessagePolicy: File", "- name: SOURCE_POD_UID", "nodeName: ${NODE_NAME}"} {
		commentAbove(t, doc, line)
	}
	if !strings.Contains(doc, "TEMPLATE") {
		t.Error("the Job template does not say it is one")
	}
}

func TestCheckpointJobFilledIn(t *testing.T) {
	o := Options{Namespace: "snaps", SocketGroup: 3000}
	job := CheckpointJob(o, Checkpoint{
		Name: "ckpt-1", Node: "node-7", PodUID: "0b1c8e0e-8a7e-4c3e-9d55-2f0c6a7e1f00",
		Container: "qemu", QMP: "/vm/run/qmp.sock", Image: "reg.example/vm/state:1", Mode: "live",
	})
	spec := job.Spec.Template.Spec
	if job.Name != "ckpt-1" || job.GenerateName != "" || job.Namespace != "snaps" || spec.NodeName != "node-7" {
		t.Errorf("job %s/%s (generateName %q) on %q", job.Namespace, job.Name, job.GenerateName, spec.NodeName)
	}
	if job.Labels[LabelSourcePodUID] != "0b1c8e0e-8a7e-4c3e-9d55-2f0c6a7e1f00" ||
		job.Spec.Template.Labels[LabelSourcePodUID] != job.Labels[LabelSourcePodUID] {
		t.Errorf("labels %v / %v", job.Labels, job.Spec.Template.Labels)
	}
	c := spec.Containers[0]
	if c.Env[0].Value != "0b1c8e0e-8a7e-4c3e-9d55-2f0c6a7e1f00" {
		t.Errorf("env %+v", c.Env)
	}
	args := strings.Join(c.Command, " ")
	if strings.Contains(args, "--disk") || !strings.HasSuffix(args, "--image reg.example/vm/state:1 --mode live") {
		t.Errorf("command %q", args)
	}
	if !slices.Equal(spec.SecurityContext.SupplementalGroups, []int64{3000}) {
		t.Errorf("supplementalGroups %v", spec.SecurityContext.SupplementalGroups)
	}
	// Each checkpoint gets its own objects: nothing shared with the next.
	job.Labels["x"] = "y"
	if _, ok := CheckpointJob(o, Checkpoint{}).Labels["x"]; ok {
		t.Error("objects share maps")
	}
}

func TestRestoreInitContainer(t *testing.T) {
	o := Options{}
	c, vols := RestoreInitContainer(o)
	spec := corev1.PodSpec{Volumes: vols}

	checkHardened(t, "restore", nil, c, nil)
	checkNonRoot(t, "restore", c)
	if *c.SecurityContext.RunAsUser != DefaultNonRootUser || *c.SecurityContext.RunAsGroup != DefaultNonRootUser {
		t.Errorf("runs as %d:%d", *c.SecurityContext.RunAsUser, *c.SecurityContext.RunAsGroup)
	}
	if lim := c.Resources.Limits[corev1.ResourceEphemeralStorage]; lim.Cmp(o.withDefaults().RestoreStateSizeLimit) < 0 {
		t.Errorf("ephemeral-storage limit %s is below the state volume's size limit", lim.String())
	}
	want := []string{"vmsnap", "restore", "--image", "${STATE_REPO}@${STATE_DIGEST}",
		"--disk-image", "${DISK_REPO}@${DISK_DIGEST}", "--disk", "/vm/disk/overlay.qcow2", "--to-dir", "/vm/state", "--max-bytes", "8589934592",
		"--marker-dir", "/vm/markers"}
	if !slices.Equal(c.Command, want) {
		t.Errorf("command %q, want %q", c.Command, want)
	}
	checkRegistrySecret(t, "restore", spec, c, DefaultPullSecret, 0o444)

	// Writable: the state and disk volumes, nothing else; no host path.
	var writable []string
	for _, m := range c.VolumeMounts {
		if !m.ReadOnly {
			writable = append(writable, m.Name+":"+m.MountPath)
		}
	}
	if want := []string{"vmsnap-state:/vm/state", "vm-disk:/vm/disk", "vmsnap-markers:/vm/markers"}; !slices.Equal(writable, want) {
		t.Errorf("writable mounts %q, want %q", writable, want)
	}
	for _, v := range vols {
		if v.HostPath != nil {
			t.Errorf("host path volume %+v", v)
		}
	}
	state := volumeOf(t, spec, "vmsnap-state")
	if state.EmptyDir == nil || state.EmptyDir.SizeLimit == nil || state.EmptyDir.SizeLimit.Cmp(resource.MustParse("8Gi")) != 0 {
		t.Errorf("state volume %+v", state)
	}

	markers := volumeOf(t, spec, "vmsnap-markers")
	if markers.EmptyDir == nil || markers.EmptyDir.Medium != "" {
		t.Errorf("marker volume %+v: want a disk-backed emptyDir, which a node reboot keeps", markers)
	}

	// The rendered pod holds the same container, after the backing file's.
	r := render(t, o)
	ps := r.pod.Spec
	if len(ps.InitContainers) != 2 || ps.InitContainers[0].Name != BackingContainerName || !equality.Semantic.DeepEqual(ps.InitContainers[1], c) {
		t.Fatalf("the pod's init containers differ from the backing file's and RestoreInitContainer's")
	}
}

func TestRestoreDiskOnlyForAgentDrivenRestore(t *testing.T) {
	c, vols := RestoreInit(Options{}, Restore{DiskImage: "reg.example/vm/disk@sha256:" + strings.Repeat("a", 64)})
	if args := strings.Join(c.Command, " "); strings.Contains(args, "--image") || strings.Contains(args, "--to-dir") ||
		!strings.Contains(args, "--disk /vm/disk/overlay.qcow2") {
		t.Errorf("command %q", args)
	}
	for _, v := range vols {
		if v.Name == DefaultRestoreStateVolume {
			t.Error("a disk-only restore has a state volume")
		}
	}
	want := []string{"vmsnap", "launch", "--defer", "--marker-dir", "/vm/markers", "--on-restart", "cold", "--", "qemu-system-x86_64"}
	if got := LaunchCommand(Options{}, Restore{DiskImage: "x"}); !slices.Equal(got, want) {
		t.Errorf("launch command %q, want %q", got, want)
	}
}

func TestAddRestore(t *testing.T) {
	own := corev1.Volume{Name: DefaultRestoreDiskVolume, VolumeSource: corev1.VolumeSource{
		PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "vm-disk"},
	}}
	spec := corev1.PodSpec{
		InitContainers: []corev1.Container{{Name: "fetch-base"}},
		Containers:     []corev1.Container{{Name: "qemu"}},
		Volumes:        []corev1.Volume{own},
	}
	c, vols := RestoreInitContainer(Options{})
	if err := AddRestore(&spec, c, vols); err != nil {
		t.Fatal(err)
	}
	if len(spec.InitContainers) != 2 || spec.InitContainers[1].Name != RestoreContainerName {
		t.Errorf("init containers %+v: want the restore last", spec.InitContainers)
	}
	var names []string
	for _, v := range spec.Volumes {
		names = append(names, v.Name)
	}
	if !slices.Equal(names, []string{DefaultRestoreDiskVolume, DefaultRestoreStateVolume, DefaultRestoreMarkerVolume, VolumeRegistry}) {
		t.Errorf("volumes %q", names)
	}
	if !reflect.DeepEqual(spec.Volumes[0], own) {
		t.Error("the pod's own disk volume was replaced")
	}
	if err := AddRestore(&spec, c, vols); err == nil {
		t.Error("adding the restore twice succeeded")
	}
}

func TestRenderIsDeterministic(t *testing.T) {
	first, err := Render(Options{})
	if err != nil {
		t.Fatal(err)
	}
	for range 20 {
		again, err := Render(Options{})
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(first, again) {
			t.Fatal("two renders of the same options differ")
		}
	}
	// Spelling the defaults out changes nothing.
	explicit := Options{
		Image: DefaultImage, ImagePullPolicy: corev1.PullIfNotPresent, Namespace: DefaultNamespace, Name: DefaultName,
		SocketGroup: DefaultSocketGroup, KVMNodeLabel: DefaultKVMNodeLabel, KVMNodeLabelValue: DefaultKVMNodeValue,
		PullSecret: DefaultPullSecret, SocketDir: DefaultSocketDir, StateDir: DefaultStateDir,
		ContainerdSocket: DefaultContainerdSocket, KubeletPodsDir: DefaultKubeletPodsDir,
		JobUser: DefaultNonRootUser, CheckpointMode: DefaultCheckpointMode,
		JobActiveDeadlineSeconds: DefaultJobActiveDeadlineSeconds, JobTTLSecondsAfterFinished: DefaultJobTTLSecondsAfterFinish,
		RestoreUser: DefaultNonRootUser, RestoreGroup: DefaultNonRootUser, RestoreStateDir: DefaultRestoreStateDir,
		RestoreStateVolume: DefaultRestoreStateVolume, RestoreStateSizeLimit: resource.MustParse(DefaultRestoreStateLimit),
		RestoreDiskPath: DefaultRestoreDiskPath, RestoreDiskVolume: DefaultRestoreDiskVolume,
		ContainerdRoot: DefaultContainerdRoot, QMPSocket: DefaultQMPSocket,
		RestoreMarkerDir: DefaultRestoreMarkerDir, RestoreMarkerVolume: DefaultRestoreMarkerVolume,
		RestoreRunVolume: DefaultRestoreRunVolume, OnRestart: DefaultOnRestart, BaseDir: DefaultBaseDir,
		AgentResources: DefaultAgentResources(), JobResources: DefaultJobResources(), RestoreResources: DefaultRestoreResources(),
	}
	b, err := Render(explicit)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(first, b) {
		t.Error("the zero Options and the spelled-out defaults render differently")
	}
}

func TestCustomOptions(t *testing.T) {
	o := Options{
		Image: "reg.example/vmsnap@sha256:" + strings.Repeat("b", 64), Namespace: "vm-ops", OmitNamespace: true,
		SocketGroup: 4242, KVMNodeLabel: "example.com/kvm", KVMNodeLabelValue: "yes", PullSecret: "snap-creds",
		SocketDir: "/run/vmsnap-2", StateDir: "/srv/vmsnap", ContainerdSocket: "/run/k3s/containerd/containerd.sock",
		ContainerdRoot: "/var/lib/rancher/k3s/agent/containerd",
		KubeletPodsDir: "/var/lib/k0s/kubelet/pods", AgentExtraCapabilities: []corev1.Capability{"CHOWN"},
		ImagePullSecrets: []string{"ghcr"}, JobUser: 1000, RestoreUser: 107, RestoreGroup: 108,
		Tolerations: []corev1.Toleration{{Key: "kvm", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}},
	}
	r := render(t, o)
	ds, doc := r.ds, r.doc(t, "DaemonSet")
	c := ds.Spec.Template.Spec.Containers[0]
	checkHardened(t, "agent", ds.Spec.Template.Spec.SecurityContext, c, []corev1.Capability{"DAC_OVERRIDE", "CHOWN"})
	commentAbove(t, doc, "- CHOWN")
	for p := range hostPaths(ds.Spec.Template.Spec) {
		commentAbove(t, doc, "path: "+p)
	}
	if hp := hostPaths(ds.Spec.Template.Spec); len(hp) != 5 || hp["/var/lib/rancher/k3s/agent/containerd"] == "" {
		t.Errorf("host paths %v", hostPaths(ds.Spec.Template.Spec))
	}
	if ds.Spec.Template.Spec.NodeSelector["example.com/kvm"] != "yes" || len(ds.Spec.Template.Spec.Tolerations) != 1 {
		t.Errorf("node selection %v %v", ds.Spec.Template.Spec.NodeSelector, ds.Spec.Template.Spec.Tolerations)
	}
	if got := AgentHealthCommand(o); got[len(got)-1] != "/run/vmsnap-2/agent.sock" || !slices.Equal(c.LivenessProbe.Exec.Command, got) {
		t.Errorf("health command %q", got)
	}
	checkRegistrySecret(t, "agent", ds.Spec.Template.Spec, c, "snap-creds", 0o400)
	if *c.SecurityContext.RunAsGroup != 4242 || r.job.Spec.Template.Spec.SecurityContext.SupplementalGroups[0] != 4242 {
		t.Error("the socket group is not shared by the agent and the Job")
	}
	if r.job.Namespace != "vm-ops" || r.job.Spec.Template.Spec.ImagePullSecrets[0].Name != "ghcr" {
		t.Errorf("job %+v", r.job.ObjectMeta)
	}
	ic := r.pod.Spec.InitContainers[1]
	if *ic.SecurityContext.RunAsUser != 107 || *ic.SecurityContext.RunAsGroup != 108 {
		t.Errorf("restore runs as %d:%d", *ic.SecurityContext.RunAsUser, *ic.SecurityContext.RunAsGroup)
	}
	checkNonRoot(t, "restore", ic)
}

func TestRenderParts(t *testing.T) {
	b, err := RenderParts(Options{}, PartAgent)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(splitDocs(t, b)); n != 3 {
		t.Errorf("agent part: %d documents, want 3", n)
	}
	b, err = RenderParts(Options{OmitNamespace: true}, PartRestore, PartJob)
	if err != nil {
		t.Fatal(err)
	}
	docs := splitDocs(t, b)
	if len(docs) != 2 || !strings.Contains(docs[0], "kind: Pod\n") || !strings.Contains(docs[1], "kind: Job") {
		t.Errorf("restore+job parts:\n%s", b)
	}
	if _, err := RenderParts(Options{}, "controller"); err == nil {
		t.Error("an unknown part rendered")
	}
}

func TestValidate(t *testing.T) {
	if err := (Options{}).Validate(); err != nil {
		t.Fatalf("the zero Options are invalid: %v", err)
	}
	for name, o := range map[string]Options{
		"relative state dir":     {StateDir: "var/lib/vmsnap"},
		"unclean socket dir":     {SocketDir: "/run/vmsnap/"},
		"root host path":         {KubeletPodsDir: "/"},
		"nested host paths":      {StateDir: "/run/vmsnap/state"},
		"same host paths":        {StateDir: "/run/vmsnap"},
		"root job":               {JobUser: -1},
		"root restore group":     {RestoreGroup: -5},
		"negative socket group":  {SocketGroup: -1},
		"bad mode":               {CheckpointMode: "fast"},
		"bad namespace":          {Namespace: "VM_Snap"},
		"bad label":              {KVMNodeLabel: "example.com/kvm node"},
		"ALL capability":         {AgentExtraCapabilities: []corev1.Capability{"ALL"}},
		"CAP_ prefix":            {AgentExtraCapabilities: []corev1.Capability{"CAP_CHOWN"}},
		"duplicate capability":   {AgentExtraCapabilities: []corev1.Capability{"DAC_OVERRIDE"}},
		"SYS_ADMIN":              {AgentExtraCapabilities: []corev1.Capability{"SYS_ADMIN"}},
		"same restore volumes":   {RestoreDiskVolume: DefaultRestoreStateVolume},
		"state dir holds disk":   {RestoreDiskPath: "/vm/state/disk/overlay.qcow2"},
		"disk at the root":       {RestoreDiskPath: "/overlay.qcow2"},
		"image with white space": {Image: "vmsnap latest"},
		"markers in the state":   {RestoreMarkerDir: "/vm/state/markers"},
		"socket in the disk dir": {QMPSocket: "/vm/disk/qmp.sock"},
		"shell character":        {RestoreStateDir: "/vm/state;rm"},
		"same marker volume":     {RestoreMarkerVolume: DefaultRestoreRunVolume},
		"bad on-restart":         {OnRestart: "reload"},
		"bad CA ConfigMap":       {RegistryCAConfigMap: "CA Map"},
		"repository with scheme": {AllowRepositories: []string{"https://reg.example/vms"}},
		"repository, no path":    {AllowRepositories: []string{"reg.example"}},
		"bad admin namespace":    {AdminNamespaces: []string{"Ops"}},
		"layout root in state":   {LayoutRoot: "/var/lib/vmsnap/layouts"},
		"negative timeout":       {OperationTimeout: -1},
	} {
		if err := o.Validate(); err == nil {
			t.Errorf("%s: valid", name)
		} else if _, err := Render(o); err == nil {
			t.Errorf("%s: Render accepted it", name)
		}
	}
}

func TestCommentPlacementIsChecked(t *testing.T) {
	obj := map[string]any{"a": map[string]any{"path": "/x"}, "b": map[string]any{"path": "/x"}, "c": 1}
	if _, err := (document{obj: obj, notes: []note{{"path: /x", "twice"}}}).render(); err == nil {
		t.Error("a comment for a line that appears twice was placed")
	}
	if _, err := (document{obj: obj, notes: []note{{"path: /y", "nowhere"}}}).render(); err == nil {
		t.Error("a comment for a missing line was placed")
	}
	b, err := (document{header: []string{"head"}, obj: obj, notes: []note{{"c:", strings.Repeat("word ", 40)}}}).render()
	if err != nil {
		t.Fatal(err)
	}
	var back map[string]any
	if err := yaml.UnmarshalStrict(b, &back); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(back) != fmt.Sprint(obj) {
		t.Errorf("comments changed the data: %v", back)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if len(l) > commentWidth {
			t.Errorf("line longer than %d: %q", commentWidth, l)
		}
	}
}
