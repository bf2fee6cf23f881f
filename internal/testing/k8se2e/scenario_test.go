package k8se2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/vmsnap/vmsnap/internal/manifests"
	"github.com/vmsnap/vmsnap/internal/testing/cluster"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
)

// Names the scenario uses.
const (
	vmNamespacePrefix = "vms"
	caConfigMap       = "registry-ca"
	qmpSocket         = "/vm/run/qmp.sock"
	diskPath          = "/vm/disk/overlay.qcow2"
	backingFile       = "base.qcow2"
)

// scenario is the state the steps hand on to each other.
type scenario struct {
	c            *cluster.Cluster
	reg          *registry.Registry
	vmsnap       string // the built binary, run on the host for `manifests`
	vmsnapImage  string
	qemuImage    string
	opts         manifests.Options // what the agent was rendered with
	manifestArgs []string          // the same, as `vmsnap manifests` flags
	vmNS         string

	source                  *corev1.Pod
	sourceLast              guest.Status // the source guest's last status before the checkpoint
	stateDigest, diskDigest string
	checkpointDigest        string // the checkpoint's index, in vms/state: it links the disk in vms/disk
	restored                *corev1.Pod
	viaAgent                *corev1.Pod
}

// TestKubernetes runs the scenario of issue 13 on one cluster, step by
// step: a step that fails stops the rest.
func TestKubernetes(t *testing.T) {
	guest.Assets(t) // skips (or fails in CI) before the cluster starts
	// The agent's host paths (the DaemonSet's DirectoryOrCreate volumes)
	// are removed after the cluster stopped, if this run makes them.
	removeHostDirsAfter(t, manifests.DefaultSocketDir, manifests.DefaultStateDir)
	s := &scenario{c: cluster.Start(t)}
	s.vmsnap = cluster.VMSnapBinary(t)
	s.vmsnapImage = s.c.ImportVMSnapImage(t, s.vmsnap)
	s.qemuImage = s.c.ImportQEMUImage(t, s.vmsnap)
	s.reg = registry.Start(t, registry.OnAddress(s.c.NodeIP))
	for _, step := range []struct {
		name string
		run  func(t *testing.T)
	}{
		{"Agent", s.agent},
		{"SourceVM", s.sourceVM},
		{"Checkpoint", s.checkpoint},
		{"Restore", s.restore},
		{"QEMURestart", s.qemuRestart},
		{"InitRerun", s.initRerun},
		{"RestoreViaAgent", s.restoreViaAgent},
		{"VMNotFound", s.vmNotFound},
		{"MemoryFile", s.memoryFile},
	} {
		if !t.Run(step.name, step.run) {
			return
		}
	}
}

// agent applies `vmsnap manifests --part agent` as printed, with only the
// options a user of this node would give (its image, its node paths, the
// registry's CA and repository), and waits for the DaemonSet's pod to
// answer /healthz.
func (s *scenario) agent(t *testing.T) {
	c := s.c
	s.opts = manifests.Options{Image: s.vmsnapImage}
	s.manifestArgs = []string{
		"--image", s.vmsnapImage,
		"--containerd-socket", c.Containerd.Address,
		"--containerd-root", c.ContainerdRoot,
		"--kubelet-pods-dir", filepath.Join(c.KubeletRoot, "pods"),
		"--registry-ca-configmap", caConfigMap,
		"--allow-repository", s.reg.Host + "/vms",
	}
	yaml := s.manifests(t, "agent")
	c.Kubectl(t, nil, "label", "node", c.NodeName, manifests.DefaultKVMNodeLabel+"="+manifests.DefaultKVMNodeValue)
	s.apply(t, yaml)
	s.registryObjects(t, manifests.DefaultNamespace)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pod := s.agentPod(t, ctx)
	c.WaitPodReady(t, ctx, pod.Namespace, pod.Name)
	out, err := c.KubectlErr(nil, "-n", pod.Namespace, "exec", pod.Name, "--",
		"vmsnap", "agent", "health", "--socket", manifests.AgentSocket(s.opts))
	if err != nil {
		t.Fatalf("vmsnap agent health in the agent's pod: %v\n%s", err, out)
	}
	t.Logf("agent health: %s", strings.TrimSpace(out))
}

// apply applies printed YAML with kubectl, which must neither fail nor warn
// (a Pod Security warning, an unknown field).
func (s *scenario) apply(t *testing.T, yaml []byte) {
	t.Helper()
	out, stderr, err := s.c.KubectlOutput(yaml, "apply", "-f", "-")
	if err != nil || strings.TrimSpace(stderr) != "" {
		t.Fatalf("kubectl apply: %v\n%s%s", err, out, stderr)
	}
	t.Logf("kubectl apply: %s", strings.TrimSpace(out))
}

// manifests runs `vmsnap manifests --part part` with the scenario's flags.
func (s *scenario) manifests(t *testing.T, part string, extra ...string) []byte {
	t.Helper()
	args := append([]string{"manifests", "--part", part}, s.manifestArgs...)
	out, err := exec.Command(s.vmsnap, append(args, extra...)...).Output()
	if err != nil {
		t.Fatalf("vmsnap %s: %v\n%s", strings.Join(args, " "), err, stderrOf(err))
	}
	return out
}

func stderrOf(err error) string {
	if ee, ok := err.(*exec.ExitError); ok {
		return string(ee.Stderr)
	}
	return ""
}

// registryObjects creates, in ns, the pull secret (the registry's
// credentials, as `kubectl create secret docker-registry` would) and the
// ConfigMap with its CA.
func (s *scenario) registryObjects(t *testing.T, ns string) {
	t.Helper()
	s.c.Kubectl(t, nil, "-n", ns, "create", "secret", "generic", manifests.DefaultPullSecret,
		"--type=kubernetes.io/dockerconfigjson", "--from-file=.dockerconfigjson="+s.reg.AuthFile)
	s.c.Kubectl(t, nil, "-n", ns, "create", "configmap", caConfigMap, "--from-file=ca.pem="+s.reg.CAFile)
}

func (s *scenario) agentPod(t *testing.T, ctx context.Context) *corev1.Pod {
	t.Helper()
	for {
		pods, err := s.c.Client.CoreV1().Pods(manifests.DefaultNamespace).List(ctx, metav1.ListOptions{
			LabelSelector: "app.kubernetes.io/component=agent"})
		if err == nil && len(pods.Items) == 1 {
			return &pods.Items[0]
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no agent pod: %v (err %v)\n%s", ctx.Err(), err,
				s.c.Describe(manifests.DefaultNamespace, "daemonset", manifests.DefaultName))
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// removeHostDirsAfter removes, when t ends, those of dirs (the agent's
// host paths) that do not exist now.
func removeHostDirsAfter(t *testing.T, dirs ...string) {
	for _, d := range dirs {
		if _, err := os.Stat(d); os.IsNotExist(err) {
			t.Cleanup(func() { os.RemoveAll(d) })
		}
	}
}

// qemuArgs are the test guest's QEMU options in a pod: its console on the
// container's standard output (the pod's log), its monitor in the vm-run
// volume, its disk an overlay in the vm-disk volume.
func qemuArgs() []string {
	return []string{
		"-accel", "tcg", "-machine", "pc", "-m", "256", "-smp", "1",
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-kernel", cluster.QEMUImageKernel, "-initrd", cluster.QEMUImageInitrd,
		"-append", guest.KernelCmdline + " vmsnap.mem_mb=16",
		// Not a file chardev on /dev/stdout: that reopens the log pipe,
		// which belongs to root.
		"-serial", "stdio",
		"-qmp", "unix:" + qmpSocket + ",server=on,wait=off",
		"-drive", "file=" + diskPath + ",if=virtio,format=qcow2,cache=writeback",
	}
}

// restricted is the container security context the restricted Pod
// Security level asks for, as QEMU's user.
func restricted() *corev1.SecurityContext {
	f, uid := false, int64(manifests.DefaultNonRootUser)
	return &corev1.SecurityContext{
		RunAsNonRoot: ptr(true), RunAsUser: &uid, RunAsGroup: &uid,
		AllowPrivilegeEscalation: &f, ReadOnlyRootFilesystem: ptr(true),
		Capabilities:   &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
		SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
	}
}

func ptr[T any](v T) *T { return &v }

// sourceVM runs the test guest in a pod of a namespace enforcing the
// restricted Pod Security level: an init container makes its disk (the
// backing file copied from the image, a qcow2 overlay on it), QEMU runs it.
func (s *scenario) sourceVM(t *testing.T) {
	c := s.c
	s.vmNS = c.Namespace(t, vmNamespacePrefix, map[string]string{"pod-security.kubernetes.io/enforce": "restricted"})
	s.registryObjects(t, s.vmNS)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	mounts := []corev1.VolumeMount{{Name: "vm-disk", MountPath: "/vm/disk"}, {Name: "vm-run", MountPath: "/vm/run"}}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "source", Namespace: s.vmNS},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken: ptr(false),
			SecurityContext:              &corev1.PodSecurityContext{SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}},
			InitContainers: []corev1.Container{{
				Name: "disk", Image: s.qemuImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"/bin/sh", "-c", "cp " + cluster.QEMUImageBaseDisk + " /vm/disk/" + backingFile +
					" && qemu-img create -q -f qcow2 -b " + backingFile + " -F qcow2 " + diskPath},
				VolumeMounts: mounts[:1], SecurityContext: restricted(),
			}},
			Containers: []corev1.Container{{
				Name: "qemu", Image: s.qemuImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{guest.QEMUBinary}, Args: qemuArgs(),
				VolumeMounts: mounts, SecurityContext: restricted(),
			}},
			Volumes: []corev1.Volume{
				{Name: "vm-disk", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
				{Name: "vm-run", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
			},
		},
	}
	s.source = c.RunPod(t, ctx, pod)
	st := s.waitStatus(t, ctx, s.source, func(st guest.Status) bool { return st.Counter >= 3 })
	if st.Mem != st.Mem0 || !strings.HasPrefix(st.Disk, guest.MarkerPrefix) {
		t.Fatalf("source guest: %s (want mem == mem0 and a disk marker)", st)
	}
	t.Logf("source guest: %s", st)
}

// statuses parses the guest's status lines out of the qemu container's log
// (the previous container's with previous).
func (s *scenario) statuses(ctx context.Context, pod *corev1.Pod, previous bool) ([]guest.Status, error) {
	b, err := s.c.Client.CoreV1().Pods(pod.Namespace).GetLogs(pod.Name, &corev1.PodLogOptions{Container: "qemu", Previous: previous}).DoRaw(ctx)
	if err != nil {
		return nil, err
	}
	var out []guest.Status
	for _, line := range strings.Split(string(b), "\n") {
		if st, ok := guest.ParseStatus(line); ok {
			out = append(out, st)
		}
	}
	return out, nil
}

// waitStatus waits for a status line of the pod's guest that matches.
func (s *scenario) waitStatus(t *testing.T, ctx context.Context, pod *corev1.Pod, match func(guest.Status) bool) guest.Status {
	t.Helper()
	var last []guest.Status
	for {
		sts, err := s.statuses(ctx, pod, false)
		if err == nil {
			last = sts
			for _, st := range sts {
				if match(st) {
					return st
				}
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("guest of %s/%s: no matching status (%d lines; last error %v)\n%s\n%s\n%s", pod.Namespace, pod.Name,
				len(last), err, tailStatuses(last), s.logTail(pod), s.c.Describe(pod.Namespace, "pod", pod.Name))
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// logTail is the end of the qemu container's log, and of the previous
// one's, for failure messages.
func (s *scenario) logTail(pod *corev1.Pod) string {
	var b strings.Builder
	for _, previous := range []bool{true, false} {
		lines := int64(15)
		out, err := s.c.Client.CoreV1().Pods(pod.Namespace).GetLogs(pod.Name, &corev1.PodLogOptions{
			Container: "qemu", Previous: previous, TailLines: &lines}).DoRaw(context.Background())
		fmt.Fprintf(&b, "--- qemu log (previous=%v, err=%v):\n%s\n", previous, err, out)
	}
	return b.String()
}

func tailStatuses(sts []guest.Status) string {
	if len(sts) > 5 {
		sts = sts[len(sts)-5:]
	}
	var b strings.Builder
	for _, st := range sts {
		fmt.Fprintln(&b, st)
	}
	return b.String()
}

// checkpointOutput is the part of the checkpoint Job's result JSON (its
// termination message) the restore needs.
type checkpointOutput struct {
	Checkpoint *struct {
		Image, Digest string
	} `json:"checkpoint"`
	VMState struct {
		Image, Digest string
	} `json:"vmstate"`
	Disk *struct {
		Image, Digest, BackingFile string
	} `json:"disk"`
}

// checkpoint runs the Job a controller would create (manifests.
// CheckpointJob) on the source pod's node and reads the digests from the
// termination message in the pod's status.
func (s *scenario) checkpoint(t *testing.T) {
	c := s.c
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	job := manifests.CheckpointJob(s.opts, manifests.Checkpoint{
		Name: "checkpoint-source", Node: s.source.Spec.NodeName, PodUID: string(s.source.UID),
		Container: "qemu", QMP: qmpSocket, Disk: diskPath,
		Image: s.reg.Host + "/vms/state:1", DiskImage: s.reg.Host + "/vms/disk:1",
	})
	// Created as a controller would, with no warning: the Job and the
	// namespace's Pod Security labels agree.
	var warnings warningRecorder
	cfg := rest.CopyConfig(c.Config)
	cfg.WarningHandler = &warnings
	controller, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := controller.BatchV1().Jobs(job.Namespace).Create(ctx, job, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating the checkpoint Job: %v", err)
	}
	if len(warnings.texts) > 0 {
		t.Errorf("creating the checkpoint Job: warnings %q", warnings.texts)
	}
	msg := c.JobTerminationMessage(t, ctx, job.Namespace, job.Name)
	var out checkpointOutput
	if err := json.Unmarshal([]byte(msg), &out); err != nil || out.Disk == nil {
		t.Fatalf("termination message %q: %v", msg, err)
	}
	if out.Checkpoint == nil || !isDigest(out.Checkpoint.Digest) || !isDigest(out.VMState.Digest) || !isDigest(out.Disk.Digest) {
		t.Fatalf("termination message without digests: %q", msg)
	}
	s.checkpointDigest, s.stateDigest, s.diskDigest = out.Checkpoint.Digest, out.VMState.Digest, out.Disk.Digest
	sts, err := s.statuses(ctx, s.source, false)
	if err != nil || len(sts) == 0 {
		t.Fatalf("source guest's statuses: %v", err)
	}
	s.sourceLast = sts[len(sts)-1]
	t.Logf("checkpoint %s: state %s, disk %s; source guest at %s", s.checkpointDigest, s.stateDigest, s.diskDigest, s.sourceLast)

	// The source goes away before its restore, as on a node drain.
	if err := c.Client.CoreV1().Pods(s.vmNS).Delete(ctx, s.source.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	c.WaitPodGone(t, ctx, s.vmNS, s.source.Name)
}

// warningRecorder keeps the warnings the apiserver sends a client.
type warningRecorder struct {
	mu    sync.Mutex
	texts []string
}

func (w *warningRecorder) HandleWarningHeader(_ int, _ string, text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.texts = append(w.texts, text)
}

var digestRE = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)

func isDigest(s string) bool { return digestRE.MatchString(s) }

// placeholder is a ${NAME} of the printed templates.
var placeholder = regexp.MustCompile(`\$\{([A-Z_]+)\}`)

// fill replaces every ${NAME} placeholder of a printed template with
// values[NAME], as envsubst with those names would; a placeholder without a
// value fails t.
func fill(t *testing.T, tmpl []byte, values map[string]string) []byte {
	t.Helper()
	var missing []string
	out := placeholder.ReplaceAllFunc(tmpl, func(m []byte) []byte {
		name := string(m[2 : len(m)-1])
		v, ok := values[name]
		if !ok {
			missing = append(missing, name)
		}
		return []byte(v)
	})
	if len(missing) > 0 {
		t.Fatalf("the template has placeholders the scenario does not know: %v", missing)
	}
	return out
}

// restore applies `vmsnap manifests --part restore` with its placeholders
// filled in, and checks that the guest carries on where it stopped.
func (s *scenario) restore(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	s.restored = s.applyRestorePod(t, ctx, "restored")
	s.carriesOn(t, ctx, s.restored)
}

// applyRestorePod applies the restore template (with extra `vmsnap
// manifests` flags) filled in for the checkpoint, as pod name, and waits
// until it runs.
func (s *scenario) applyRestorePod(t *testing.T, ctx context.Context, name string, extra ...string) *corev1.Pod {
	t.Helper()
	args, err := json.Marshal(qemuArgs())
	if err != nil {
		t.Fatal(err)
	}
	// Both named by the checkpoint, as a controller that keeps only its
	// digest would: the init container takes the state from its index,
	// and the disk from the repository the index links.
	yaml := fill(t, s.manifests(t, "restore", extra...), map[string]string{
		"POD_NAME": name, "NAMESPACE": s.vmNS, "QEMU_IMAGE": s.qemuImage, "QEMU_ARGS": string(args),
		"BACKING_FILE": backingFile,
		"STATE_REPO":   s.reg.Host + "/vms/state", "STATE_DIGEST": s.checkpointDigest,
		"DISK_REPO": s.reg.Host + "/vms/state", "DISK_DIGEST": s.checkpointDigest,
	})
	s.apply(t, yaml)
	return s.c.WaitPodReady(t, ctx, s.vmNS, name)
}

// carriesOn waits for the pod's guest to count past the source's last
// line and checks it is the source's boot, memory and disk.
func (s *scenario) carriesOn(t *testing.T, ctx context.Context, pod *corev1.Pod) guest.Status {
	t.Helper()
	st := s.waitStatus(t, ctx, pod, func(st guest.Status) bool { return st.Counter > s.sourceLast.Counter })
	if st.Boot != s.sourceLast.Boot || st.Mem0 != s.sourceLast.Mem0 || st.Mem != st.Mem0 || st.Disk != s.sourceLast.Disk {
		t.Fatalf("restored guest: %s\nsource guest: %s\nwant the same boot, memory and disk", st, s.sourceLast)
	}
	t.Logf("restored guest of %s carries on: %s", pod.Name, st)
	return st
}

// qemuRestart kills the restored pod's QEMU: the kubelet restarts the
// container, and the snapshot's memory must not be loaded again: the guest
// boots cold from its disk (the launcher's default).
func (s *scenario) qemuRestart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	before := restarts(s.restored, "qemu")
	s.killTask(t, ctx, s.containerTask(t, ctx, s.restored, "qemu"))
	p := s.c.WaitPod(t, ctx, s.vmNS, s.restored.Name, func(p *corev1.Pod) bool {
		return restarts(p, "qemu") > before && ready(p, "qemu")
	})
	s.coldBoot(t, ctx, p)
}

// coldBoot checks that the pod's (new) QEMU booted its guest afresh, from
// the restored disk, and never ran the snapshot's memory.
func (s *scenario) coldBoot(t *testing.T, ctx context.Context, p *corev1.Pod) {
	t.Helper()
	st := s.waitStatus(t, ctx, p, func(guest.Status) bool { return true })
	sts, err := s.statuses(ctx, p, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, old := range sts {
		if old.Boot == s.sourceLast.Boot || old.Mem0 == s.sourceLast.Mem0 {
			t.Fatalf("the restarted QEMU ran the snapshot's memory again: %s\n%s", old, s.logTail(p))
		}
	}
	if st.Disk != s.sourceLast.Disk {
		t.Fatalf("the cold-booted guest's disk holds %q, want the restored overlay's marker %q", st.Disk, s.sourceLast.Disk)
	}
	t.Logf("restarted QEMU booted cold from the restored disk: %s", st)
}

func containerStatus(p *corev1.Pod, name string) (corev1.ContainerStatus, bool) {
	for _, st := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		if st.Name == name {
			return st, true
		}
	}
	return corev1.ContainerStatus{}, false
}

func restarts(p *corev1.Pod, name string) int32 {
	st, _ := containerStatus(p, name)
	return st.RestartCount
}

func ready(p *corev1.Pod, name string) bool {
	st, ok := containerStatus(p, name)
	return ok && st.Ready && st.State.Running != nil
}

// initRerun kills the restored pod's sandbox: the kubelet makes a new one
// and runs the init containers again. The restore must leave the overlay
// the guest has used in place (the same file), and QEMU boot cold.
func (s *scenario) initRerun(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	overlay := filepath.Join(s.c.KubeletRoot, "pods", string(s.restored.UID), "volumes", "kubernetes.io~empty-dir",
		manifests.DefaultRestoreDiskVolume, filepath.Base(diskPath))
	before, err := os.Stat(overlay)
	if err != nil {
		t.Fatalf("the restored overlay on the node: %v", err)
	}
	p, err := s.c.Client.CoreV1().Pods(s.vmNS).Get(ctx, s.restored.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	initBefore, qemuBefore := restarts(p, initContainer), restarts(p, "qemu")
	s.killTask(t, ctx, s.containerTask(t, ctx, p, ""))
	p = s.c.WaitPod(t, ctx, s.vmNS, s.restored.Name, func(p *corev1.Pod) bool {
		return restarts(p, initContainer) > initBefore && restarts(p, "qemu") > qemuBefore && ready(p, "qemu")
	})
	after, err := os.Stat(overlay)
	if err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(before, after) {
		t.Fatalf("the re-run init container replaced the overlay %s", overlay)
	}
	logs, err := s.c.KubectlErr(nil, "-n", s.vmNS, "logs", p.Name, "-c", initContainer)
	if err != nil || !strings.Contains(logs, "already") || !strings.Contains(logs, "marker") {
		t.Fatalf("the re-run init container's log does not mention its marker (%v):\n%s", err, logs)
	}
	t.Logf("re-run init container: %s", strings.TrimSpace(logs))
	s.coldBoot(t, ctx, p)
}

// initContainer is the restore init container's name.
const initContainer = "vmsnap-restore"

// restoreViaAgent applies the `-incoming defer` variant of the restore
// template and has the agent load the state, from a Job in the agent's
// namespace (as a controller would): the result, which the client takes
// from the operation's final event, carries the new endpoint.
func (s *scenario) restoreViaAgent(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	s.viaAgent = s.applyRestorePod(t, ctx, "restored-via-agent", "--restore-via-agent")
	job := manifests.CheckpointJob(s.opts, manifests.Checkpoint{
		Name: "restore-via-agent", Node: s.viaAgent.Spec.NodeName, PodUID: string(s.viaAgent.UID), Container: "qemu",
	})
	job.Spec.Template.Spec.Containers[0].Command = []string{
		"vmsnap", "restore", "--agent", "unix://" + manifests.AgentSocket(s.opts), "--json",
		"--termination-log", manifests.TerminationLog, "--pod-uid", "$(" + manifests.EnvSourcePodUID + ")",
		"--container", "qemu", "--qmp", qmpSocket, "--image", s.reg.Host + "/vms/state@" + s.checkpointDigest,
	}
	if _, err := s.c.Client.BatchV1().Jobs(job.Namespace).Create(ctx, job, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	msg := s.c.JobTerminationMessage(t, ctx, job.Namespace, job.Name)
	var res struct {
		Endpoint *struct{ PodUID, Container, QMP string } `json:"endpoint"`
	}
	if err := json.Unmarshal([]byte(msg), &res); err != nil || res.Endpoint == nil {
		t.Fatalf("restore result without an endpoint: %q (%v)", msg, err)
	}
	if e := *res.Endpoint; e.PodUID != string(s.viaAgent.UID) || e.Container != "qemu" || e.QMP != qmpSocket {
		t.Fatalf("restore endpoint %+v, want pod %s container qemu qmp %s", e, s.viaAgent.UID, qmpSocket)
	}
	s.carriesOn(t, ctx, s.viaAgent)
}

// vmNotFound deletes the restored pods: the agent must answer VM_NOT_FOUND
// for their UIDs as soon as they are gone.
func (s *scenario) vmNotFound(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	agentPod := s.agentPod(t, ctx)
	for _, p := range []*corev1.Pod{s.viaAgent, s.restored} {
		if err := s.c.Client.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		s.c.WaitPodGone(t, ctx, p.Namespace, p.Name)
		began := time.Now()
		out, err := s.c.KubectlErr(nil, "-n", agentPod.Namespace, "exec", agentPod.Name, "--",
			"vmsnap", "checkpoint", "--agent", "unix://"+manifests.AgentSocket(s.opts), "--json",
			"--pod-uid", string(p.UID), "--container", "qemu", "--qmp", qmpSocket, "--image", s.reg.Host+"/vms/state:gone")
		took := time.Since(began)
		if err == nil || !strings.Contains(out, `"VM_NOT_FOUND"`) {
			t.Fatalf("checkpoint of deleted pod %s: err %v, output %s; want VM_NOT_FOUND", p.Name, err, out)
		}
		if took > 10*time.Second {
			t.Errorf("VM_NOT_FOUND for deleted pod %s took %v", p.Name, took)
		}
		t.Logf("deleted pod %s: VM_NOT_FOUND after %v", p.Name, took.Round(time.Millisecond))
	}
}

// containerTask finds the running task of the pod's container (the
// sandbox's with name ""), through the node's containerd.
func (s *scenario) containerTask(t *testing.T, ctx context.Context, pod *corev1.Pod, name string) client.Task {
	t.Helper()
	filter := fmt.Sprintf(`labels."io.kubernetes.pod.uid"==%q`, pod.UID)
	if name == "" {
		filter += `,labels."io.cri-containerd.kind"==sandbox`
	} else {
		filter += fmt.Sprintf(`,labels."io.kubernetes.container.name"==%q`, name)
	}
	cctx := s.c.Containerd.Context(ctx)
	containers, err := s.c.Containerd.Client.Containers(cctx, filter)
	if err != nil {
		t.Fatal(err)
	}
	for _, ctr := range containers {
		task, err := ctr.Task(cctx, nil)
		if err != nil {
			continue
		}
		if st, err := task.Status(cctx); err == nil && st.Status == client.Running {
			return task
		}
	}
	t.Fatalf("no running container %q of pod %s", name, pod.UID)
	return nil
}

// killTask kills a container's process, as a crash or the OOM killer would.
func (s *scenario) killTask(t *testing.T, ctx context.Context, task client.Task) {
	t.Helper()
	if err := task.Kill(s.c.Containerd.Context(ctx), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
}
