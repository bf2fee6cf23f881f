package cluster

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

const busyboxImage = "vmsnap.test/busybox:1"

// TestCluster proves the harness on one cluster: a plain pod runs, can be
// exec'd into and reaches the node's address; a hardened pod is admitted
// under the restricted Pod Security level and runs with its seccomp filter
// and without capabilities; a Job completes with its termination message.
// Around it: a run that died without its cleanup is cleaned up by Start, and
// the host is left as it was found (iptables, sysctls, links, cgroups).
func TestCluster(t *testing.T) {
	Require(t)
	// Hold the host lock across both looks at the host: another package's
	// cluster (the scenario's) may run meanwhile under go test ./...
	unlock, err := guest.LockFile(hostLock)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	before := hostFingerprint(t)
	stale := plantStaleRun(t)
	t.Run("Cluster", func(t *testing.T) {
		c := start(t, false)
		for _, gone := range stale {
			if _, err := os.Stat(gone); !os.IsNotExist(err) {
				t.Errorf("Start left %s of a dead run behind (%v)", gone, err)
			}
		}
		testCluster(t, c)
	})
	if after := hostFingerprint(t); after != before {
		t.Errorf("the host changed:\nbefore:\n%s\nafter:\n%s", before, after)
	}
}

func testCluster(t *testing.T, c *Cluster) {
	tarball, err := containerd.BuildImageTar(busyboxImage,
		[]containerd.File{{Path: "/bin/busybox", HostPath: "/bin/busybox"}},
		containerd.ImageConfig{Entrypoint: []string{"/bin/busybox"}, Env: []string{"PATH=/bin"}})
	if err != nil {
		t.Fatal(err)
	}
	c.ImportImageTar(t, busyboxImage, tarball)
	if out := c.Kubectl(t, nil, "get", "node", c.NodeName, "-o", "jsonpath={.status.nodeInfo.kubeletVersion}"); out != Version {
		t.Errorf("kubectl: kubelet version %q, want %s", out, Version)
	}
	t.Run("Pod", func(t *testing.T) { testPlainPod(t, c) })
	t.Run("HardenedPod", func(t *testing.T) { testHardenedPod(t, c) })
	t.Run("Job", func(t *testing.T) { testJob(t, c) })
}

// plantStaleRun makes what a test binary killed with its cluster running
// leaves: the cluster's directory (unlocked: the host lock is free), its
// bridge and its cgroups. It returns what Start must remove.
func plantStaleRun(t *testing.T) []string {
	dir, err := os.MkdirTemp("/tmp", dirPrefix)
	if err != nil {
		t.Fatal(err)
	}
	h := &hostState{Bridge: "vmsnapbrdead", Cgroup: "/" + filepath.Base(dir)}
	if err := h.save(filepath.Join(dir, "host.json")); err != nil {
		t.Fatal(err)
	}
	if err := createBridge(h.Bridge, "10.99.99.1/24"); err != nil {
		t.Fatal(err)
	}
	if err := createCgroups(h.Cgroup); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(cgroupHierarchies()[0], h.Cgroup, "kubepods"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.restore(); os.RemoveAll(dir) }) // in case Start did not
	return []string{dir, "/sys/class/net/" + h.Bridge, filepath.Join(cgroupHierarchies()[0], h.Cgroup)}
}

// hostFingerprint is what the cluster may change on the host: the iptables
// rules and chains (counters aside; a table with nothing in it counts as
// absent), the sysctls, the network links and the cgroups at the top of
// each hierarchy.
func hostFingerprint(t *testing.T) string {
	var b strings.Builder
	for _, c := range iptablesCommands {
		out, err := exec.Command(c + "-save").Output()
		if err != nil {
			t.Fatal(err)
		}
		b.WriteString(normalizeIPTables(string(out)))
	}
	for _, s := range touchedSysctls {
		v, _ := os.ReadFile("/proc/sys/" + s)
		fmt.Fprintf(&b, "%s=%s", s, v)
	}
	links, _ := os.ReadDir("/sys/class/net")
	for _, l := range links {
		fmt.Fprintln(&b, "link", l.Name())
	}
	for _, h := range cgroupHierarchies() {
		dirs, _ := filepath.Glob(filepath.Join(h, dirPrefix+"*"))
		fmt.Fprintln(&b, "cgroups", dirs)
	}
	return b.String()
}

var chainCounters = regexp.MustCompile(` \[\d+:\d+\]$`)

func normalizeIPTables(save string) string {
	var out strings.Builder
	for _, table := range strings.Split(save, "COMMIT") {
		var lines []string
		interesting := false
		for _, l := range strings.Split(table, "\n") {
			if l == "" || strings.HasPrefix(l, "#") {
				continue
			}
			l = chainCounters.ReplaceAllString(l, "")
			if strings.HasPrefix(l, "-") || (strings.HasPrefix(l, ":") && !strings.HasSuffix(l, " ACCEPT")) {
				interesting = true
			}
			lines = append(lines, l)
		}
		if interesting {
			out.WriteString(strings.Join(lines, "\n") + "\n")
		}
	}
	return out.String()
}

func testPlainPod(t *testing.T, c *Cluster) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ns := c.Namespace(t, "plain", nil)
	// Something on the node's address, as the test registry will be.
	l, err := net.Listen("tcp", c.NodeIP+":0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "hello-from-node") })}
	go srv.Serve(l)
	defer srv.Close()

	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "plain", Namespace: ns},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "main", Image: busyboxImage, ImagePullPolicy: corev1.PullNever,
			Command: []string{"/bin/busybox", "sleep", "3600"},
		}}},
	}
	pod = c.RunPod(t, ctx, pod)
	if !strings.HasPrefix(pod.Status.PodIP, c.PodSubnet) {
		t.Errorf("pod IP %q is not in the pods' subnet %s0/24", pod.Status.PodIP, c.PodSubnet)
	}
	out := c.Kubectl(t, nil, "-n", ns, "exec", "plain", "--", "/bin/busybox", "wget", "-qO-", "http://"+l.Addr().String()+"/")
	if out != "hello-from-node" {
		t.Errorf("from the pod, the node's address answered %q", out)
	}
}

func testHardenedPod(t *testing.T, c *Cluster) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ns := c.Namespace(t, "restricted", map[string]string{"pod-security.kubernetes.io/enforce": "restricted"})
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "hardened", Namespace: ns},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "main", Image: busyboxImage, ImagePullPolicy: corev1.PullNever,
			Command: []string{"/bin/busybox", "sh", "-c", "grep -E '^(Uid|CapEff|Seccomp|NoNewPrivs):' /proc/self/status; touch /x 2>/dev/null && echo rootfs-writable; sleep 3600"},
		}}},
	}
	// Admission refuses it without the restricted settings.
	if _, err := c.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err == nil || !strings.Contains(err.Error(), "restricted") {
		t.Fatalf("an unhardened pod in a restricted namespace: err = %v, want a PodSecurity refusal", err)
	}
	pod.Spec.SecurityContext = &corev1.PodSecurityContext{
		RunAsNonRoot: ptr(true), RunAsUser: ptr(int64(65532)), RunAsGroup: ptr(int64(65532)),
		SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
	}
	pod.Spec.Containers[0].SecurityContext = &corev1.SecurityContext{
		AllowPrivilegeEscalation: ptr(false), ReadOnlyRootFilesystem: ptr(true),
		Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
	}
	c.RunPod(t, ctx, pod)
	var logs string
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(logs, "NoNewPrivs") && time.Now().Before(deadline) {
		logs, _ = c.KubectlErr(nil, "-n", ns, "logs", "hardened")
		time.Sleep(200 * time.Millisecond)
	}
	for _, want := range []string{"Uid:\t65532\t65532", "CapEff:\t0000000000000000", "Seccomp:\t2", "NoNewPrivs:\t1"} {
		if !strings.Contains(logs, want) {
			t.Errorf("hardened pod's status lacks %q:\n%s", want, logs)
		}
	}
	if strings.Contains(logs, "rootfs-writable") {
		t.Errorf("the read-only root file system was writable")
	}
}

func testJob(t *testing.T, c *Cluster) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ns := c.Namespace(t, "job", nil)
	job := &batchv1.Job{
		ObjectMeta: metav1.ObjectMeta{Name: "once", Namespace: ns},
		Spec: batchv1.JobSpec{
			BackoffLimit: ptr(int32(0)),
			Template: corev1.PodTemplateSpec{Spec: corev1.PodSpec{
				RestartPolicy: corev1.RestartPolicyNever,
				Containers: []corev1.Container{{
					Name: "main", Image: busyboxImage, ImagePullPolicy: corev1.PullNever,
					Command:                  []string{"/bin/busybox", "sh", "-c", "echo progress; echo '{\"result\":42}' > /dev/termination-log"},
					TerminationMessagePolicy: corev1.TerminationMessageReadFile,
				}},
			}},
		},
	}
	if _, err := c.Client.BatchV1().Jobs(ns).Create(ctx, job, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	msg := c.JobTerminationMessage(t, ctx, ns, "once")
	if msg != "{\"result\":42}\n" {
		t.Errorf("termination message %q", msg)
	}
}

func ptr[T any](v T) *T { return &v }

// TestBinaries builds (or finds cached) the Kubernetes binaries and checks
// that each one reports Version: the apiserver derives its emulation
// version from it. make test runs it first, so that the build does not
// compete with the tests that measure time.
func TestBinaries(t *testing.T) {
	Require(t)
	dir, err := Binaries()
	if err != nil {
		t.Fatal(err)
	}
	for name := range commands {
		args := []string{"--version"}
		if name == "kubectl" {
			args = []string{"version", "--client"}
		}
		out, err := exec.Command(filepath.Join(dir, name), args...).CombinedOutput()
		if err != nil || !strings.Contains(string(out), Version) {
			t.Errorf("%s %s: %v: %s (want %s)", name, strings.Join(args, " "), err, out, Version)
		}
	}
}
