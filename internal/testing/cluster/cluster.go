// Package cluster runs a real single-node Kubernetes cluster for tests:
// Debian's etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
// a kubelet (built from k8s.io/kubernetes, Version, by Binaries), with
// containerd's CRI plugin running the pods through runc
// (containerd.StartCRI) and CNI's bridge plugin giving them a private
// network on a bridge made for the run. Everything listens on 127.0.0.1 or
// on that bridge's gateway address (NodeIP), on free ports, and lives in a
// temporary directory: etcd's data, the certificates (a CA made here), the
// kubelet's root directory, containerd's root and state.
//
// No image can be pulled: the pause image (testdata/k8s/pause) is built
// here and imported, and tests import theirs with ImportImage.
//
// Start stops everything on t.Cleanup, also when the test fails (then with
// the tail of every component's log), and puts back what the kubelet and
// the bridge plugin changed on the host: the sysctls and iptables rules
// (saved before the kubelet starts), the bridge and the cgroups. One cluster
// runs at a time on a machine (a host-wide lock); a run that died without
// its cleanup is cleaned up by the next Start.
//
// Without root, the Debian packages it needs, or a Go toolchain to build the
// Kubernetes binaries, Start skips the test with the reason, unless
// VMSNAP_TEST_REQUIRE_QEMU=1 (CI), which makes it fail. -short skips.
//
// It is a test helper only: nothing outside _test.go files may import it.
package cluster

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

const (
	dirPrefix   = "vmsnap-k8s-"
	hostLock    = "/tmp/vmsnap-k8s.lock"
	etcdBinary  = "/usr/bin/etcd"
	cniBinDir   = "/usr/lib/cni"
	startupWait = 2 * time.Minute
)

// Cluster is a running single-node cluster.
type Cluster struct {
	// Dir holds everything the cluster keeps: certificates, etcd's data,
	// the kubelet's root, logs.
	Dir string
	// Kubeconfig is an admin (system:masters) kubeconfig; Client and
	// Config use it.
	Kubeconfig string
	Client     kubernetes.Interface
	Config     *rest.Config
	// NodeName is the one node's name; NodeIP its InternalIP: the gateway
	// address of the pods' bridge, reachable from every pod and from the
	// host, and nowhere else.
	NodeName, NodeIP string
	// PodSubnet is the pods' /24 (PodSubnet + "0/24"), Bridge its bridge.
	PodSubnet, Bridge string
	// KubeletRoot is the kubelet's --root-dir; pods' volumes are under
	// KubeletRoot/pods.
	KubeletRoot string
	// Containerd is the node's containerd; ContainerdRoot its root.
	Containerd     *containerd.Daemon
	ContainerdRoot string
	// CAFile is the cluster CA's certificate.
	CAFile string

	bin   string
	pki   *pki
	procs []*proc
}

// Missing says why a cluster cannot run here, or "".
func Missing() string {
	var why []string
	if m := containerd.Missing(); m != "" {
		why = append(why, m)
	}
	for _, p := range []string{etcdBinary, filepath.Join(cniBinDir, "bridge"), filepath.Join(cniBinDir, "host-local"), filepath.Join(cniBinDir, "loopback")} {
		if _, err := os.Stat(p); err != nil {
			why = append(why, p+" not found")
		}
	}
	for _, c := range []string{"go", "ip", "iptables-save", "iptables-restore", "ip6tables-save", "ip6tables-restore"} {
		if _, err := exec.LookPath(c); err != nil {
			why = append(why, c+" not found")
		}
	}
	if len(cgroupHierarchies()) == 0 {
		why = append(why, "no cgroup v1 hierarchies under /sys/fs/cgroup")
	}
	if len(why) == 0 {
		return ""
	}
	return strings.Join(why, "; ") + " (make deps: etcd-server containernetworking-plugins iptables iproute2 containerd runc, and Go)"
}

// Require skips t (fails it under VMSNAP_TEST_REQUIRE_QEMU=1) when a
// cluster cannot run here.
func Require(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("SKIPPING: Kubernetes cluster test in -short mode")
	}
	if why := Missing(); why != "" {
		guest.SkipOrFail(t, "Kubernetes cluster", why)
	}
}

// Start runs a cluster for t and waits until its node is Ready.
func Start(t testing.TB) *Cluster {
	t.Helper()
	return start(t, true)
}

// start is Start; lock false means the caller already holds the host lock
// (a test that looks at the host before and after a cluster).
func start(t testing.TB, lock bool) *Cluster {
	t.Helper()
	Require(t)
	began := time.Now()
	bin, err := Binaries()
	if err != nil {
		t.Fatalf("cluster: %v", err)
	}
	t.Logf("cluster: binaries ready in %v", time.Since(began).Round(time.Millisecond))
	if lock {
		unlock, err := guest.LockFile(hostLock)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(unlock)
	}
	began = time.Now()
	dir, err := os.MkdirTemp("/tmp", dirPrefix)
	if err != nil {
		t.Fatal(err)
	}
	c := &Cluster{Dir: dir, bin: bin, KubeletRoot: filepath.Join(dir, "kubelet"),
		NodeName: "vmsnap-node-" + randomHex(3), Bridge: "vmsnapbr" + randomHex(3)}
	staleCgroups := c.prepareHost(t)
	c.startContainerd(t)
	// Stale runs' containers are gone now (StartCRI reaped them): their
	// cgroups can go too.
	for _, cg := range staleCgroups {
		if err := removeCgroups(cg); err != nil {
			t.Logf("cluster: %v", err)
		}
	}
	t.Cleanup(func() { c.stop(t) })
	if err := c.startControlPlane(t); err != nil {
		t.Fatalf("cluster: %v\n%s", err, c.logTails())
	}
	if err := c.startKubelet(t); err != nil {
		t.Fatalf("cluster: %v\n%s", err, c.logTails())
	}
	t.Logf("cluster: node %s Ready %v after the cluster's start", c.NodeName, time.Since(began).Round(time.Millisecond))
	return c
}

// prepareHost cleans up after runs that died, saves the host settings the
// cluster may change (put back when t ends, after everything stopped: this
// cleanup is registered first) and makes the pods' bridge and the kubelet's
// cgroups. It returns the stale runs' cgroups, to be removed once their
// containers are gone.
func (c *Cluster) prepareHost(t testing.TB) (staleCgroups []string) {
	t.Helper()
	dir := c.Dir
	staleCgroups = reapStale(t, dir)
	var err error
	if c.PodSubnet, err = pickSubnet(); err != nil {
		t.Fatal(err)
	}
	c.NodeIP = c.PodSubnet + "1"
	host, err := snapshotHost()
	if err != nil {
		t.Fatalf("cluster: %v", err)
	}
	host.Bridge, host.Cgroup = c.Bridge, c.cgroupRoot()
	if err := host.save(filepath.Join(dir, "host.json")); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := host.restore(); err != nil {
			t.Errorf("cluster: restoring the host: %v", err)
		}
		removeContainerLogLinks(dir)
		for _, err := range containerd.UnmountAll(dir) {
			t.Logf("cluster: %v", err)
		}
		os.RemoveAll(dir)
	})
	if err := createCgroups(host.Cgroup); err != nil {
		t.Fatalf("cluster: cgroups: %v", err)
	}
	if err := createBridge(c.Bridge, c.NodeIP+"/24"); err != nil {
		t.Fatalf("cluster: %v", err)
	}
	return staleCgroups
}

// cgroupRoot is the kubelet's cgroupRoot: named after the cluster's
// directory, in every hierarchy.
func (c *Cluster) cgroupRoot() string { return "/" + filepath.Base(c.Dir) }

// startContainerd runs containerd with its CRI plugin configured for this
// cluster's kubelet, and imports the pause image.
func (c *Cluster) startContainerd(t testing.TB) {
	t.Helper()
	cniDir := filepath.Join(c.Dir, "cni")
	if err := os.MkdirAll(cniDir, 0o755); err != nil {
		t.Fatal(err)
	}
	// The pods' network: a bridge of their own (made in advance, see
	// createBridge) and addresses from host-local. Pods reach the node's
	// address and each other, nothing outside: no masquerading.
	conf := fmt.Sprintf(`{
  "cniVersion": "0.4.0",
  "name": "vmsnap-test",
  "plugins": [
    {"type": "bridge", "bridge": %q, "isGateway": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "%s0/24", "gateway": "%s"}]],
              "routes": [{"dst": "0.0.0.0/0"}], "dataDir": %q}},
    {"type": "loopback"}
  ]
}`, c.Bridge, c.PodSubnet, c.NodeIP, filepath.Join(c.Dir, "cni-ipam"))
	if err := os.WriteFile(filepath.Join(cniDir, "10-vmsnap.conflist"), []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	pauseTar, err := containerd.BuildImageTar(PauseImage, []containerd.File{{Path: "/pause", HostPath: filepath.Join(c.bin, "pause")}},
		containerd.ImageConfig{Entrypoint: []string{"/pause"}, User: "65535:65535"})
	if err != nil {
		t.Fatal(err)
	}
	c.Containerd = containerd.StartCRI(t, func(dir string) string {
		c.ContainerdRoot = filepath.Join(dir, "root")
		return criConfig(containerd.RuncRoot(dir), cniDir)
	})
	c.ImportImageTar(t, PauseImage, pauseTar)
}

// PauseImage is the pods' sandbox image, built from testdata/k8s/pause.
const PauseImage = "vmsnap.test/pause:1"

// criConfig is containerd 1.6's CRI plugin configuration: the facts of
// this machine (root without CAP_SYS_RESOURCE cannot set the sandbox's
// oom_score_adj unless it is restricted; network namespaces stay in the
// state directory rather than /run), and the local pause image.
func criConfig(runcRoot, cniDir string) string {
	runc, _ := exec.LookPath("runc")
	if runc == "" {
		runc = "/usr/sbin/runc"
	}
	return fmt.Sprintf(`[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_tls_streaming = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = %q
        Root = %q
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
    max_conf_num = 1
`, PauseImage, runc, runcRoot, cniBinDir, cniDir)
}

// ImportImageTar imports an OCI image tarball (containerd.BuildImageTar)
// into the node's containerd, where the kubelet finds it by name: pods use
// it with imagePullPolicy IfNotPresent or Never.
func (c *Cluster) ImportImageTar(t testing.TB, name string, tarball []byte) {
	t.Helper()
	c.Containerd.ImportTar(t, name, tarball)
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func freePorts(n int) ([]int, error) {
	var ports []int
	for range n {
		p, err := freePort()
		if err != nil {
			return nil, err
		}
		ports = append(ports, p)
	}
	return ports, nil
}

// proc is one component of the cluster, logging to a file.
type proc struct {
	name, log string
	cmd       *exec.Cmd
	done      chan struct{}
}

// run starts a component. It dies with the test binary (Pdeathsig).
func (c *Cluster) run(name, bin string, args ...string) (*proc, error) {
	p := &proc{name: name, log: filepath.Join(c.Dir, name+".log"), done: make(chan struct{})}
	f, err := os.Create(p.log)
	if err != nil {
		return nil, err
	}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Stdout, p.cmd.Stderr = f, f
	p.cmd.Dir = c.Dir
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := p.cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	os.WriteFile(filepath.Join(c.Dir, name+".pid"), []byte(strconv.Itoa(p.cmd.Process.Pid)), 0o600)
	go func() { p.cmd.Wait(); f.Close(); close(p.done) }()
	c.procs = append(c.procs, p)
	return p, nil
}

func (p *proc) stop() {
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
	}
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop stops the components, newest first (the kubelet before the
// apiserver, the apiserver before etcd); containerd, the pods' containers,
// the host settings follow in their own cleanups.
func (c *Cluster) stop(t testing.TB) {
	if t.Failed() {
		t.Logf("cluster logs:\n%s", c.logTails())
	}
	for i := len(c.procs) - 1; i >= 0; i-- {
		c.procs[i].stop()
	}
}

// logTails is the end of every component's log.
func (c *Cluster) logTails() string {
	var b strings.Builder
	for _, p := range c.procs {
		data, _ := os.ReadFile(p.log)
		fmt.Fprintf(&b, "==== %s (%s) ====\n%s\n", p.name, p.log, tail(data, 1500))
	}
	if c.Containerd != nil {
		data, _ := os.ReadFile(filepath.Join(c.Containerd.Dir, "containerd.log"))
		fmt.Fprintf(&b, "==== containerd ====\n%s\n", tail(data, 1500))
	}
	return b.String()
}

// waitFor polls cond every 100 ms until it is true, a component exits, or
// timeout passes.
func (c *Cluster) waitFor(what string, timeout time.Duration, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	var last error
	for {
		ok, err := cond()
		if ok {
			return nil
		}
		last = err
		for _, p := range c.procs {
			if p.exited() {
				return fmt.Errorf("%s exited while waiting for %s: %v", p.name, what, p.cmd.ProcessState)
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: not within %v (last error: %v)", what, timeout, last)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (c *Cluster) connect() error {
	cfg, err := clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	if err != nil {
		return err
	}
	cfg.QPS, cfg.Burst = 100, 200
	c.Config = cfg
	c.Client, err = kubernetes.NewForConfig(cfg)
	return err
}

// nodeReady reports whether the node's Ready condition is True.
func (c *Cluster) nodeReady() (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	n, err := c.Client.CoreV1().Nodes().Get(ctx, c.NodeName, metav1.GetOptions{})
	if err != nil {
		return false, err
	}
	for _, cond := range n.Status.Conditions {
		if cond.Type == corev1.NodeReady {
			return cond.Status == corev1.ConditionTrue, fmt.Errorf("node condition Ready=%s: %s", cond.Status, cond.Message)
		}
	}
	return false, nil
}

// Kubectl runs the cluster's kubectl (built with it) with the admin
// kubeconfig and returns its standard output; stdin may be nil.
func (c *Cluster) Kubectl(t testing.TB, stdin []byte, args ...string) string {
	t.Helper()
	out, err := c.KubectlErr(stdin, args...)
	if err != nil {
		t.Fatalf("kubectl %s: %v", strings.Join(args, " "), err)
	}
	return out
}

// KubectlErr is Kubectl returning the error (with kubectl's stderr).
func (c *Cluster) KubectlErr(stdin []byte, args ...string) (string, error) {
	out, stderr, err := c.KubectlOutput(stdin, args...)
	if err != nil {
		return out, fmt.Errorf("%v: %s", err, strings.TrimSpace(stderr))
	}
	return out, nil
}

// KubectlOutput runs kubectl and returns its standard output and error
// apart: a command that succeeds may still warn on stderr.
func (c *Cluster) KubectlOutput(stdin []byte, args ...string) (stdout, stderr string, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(c.bin, "kubectl"), append([]string{"--kubeconfig", c.Kubeconfig}, args...)...)
	if stdin != nil {
		cmd.Stdin = strings.NewReader(string(stdin))
	}
	var errb strings.Builder
	cmd.Stderr = &errb
	out, err := cmd.Output()
	return string(out), errb.String(), err
}

// reapStale cleans up after runs that died without their cleanup: with
// the host lock held, every other cluster directory is stale. Its
// processes died with their test binary; its containers were reaped by
// internal/testing/containerd, or are by the next StartCRI.
// It returns the stale runs' cgroups, to be removed once their containers
// are.
func reapStale(t testing.TB, except string) (cgroups []string) {
	dirs, _ := filepath.Glob(filepath.Join("/tmp", dirPrefix+"*"))
	for _, dir := range dirs {
		if dir == except {
			continue
		}
		t.Logf("cluster: cleaning up %s, left by a test binary that died", dir)
		for _, name := range []string{"kubelet", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd"} {
			if b, err := os.ReadFile(filepath.Join(dir, name+".pid")); err == nil {
				if pid, err := strconv.Atoi(string(b)); err == nil && processIs(pid, name) {
					syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
		removeContainerLogLinks(dir)
		if h, err := loadHostState(filepath.Join(dir, "host.json")); err == nil {
			cgroups = append(cgroups, h.Cgroup)
			h.Cgroup = ""
			if err := h.restore(); err != nil {
				t.Logf("cluster: %v", err)
			}
		}
		for _, err := range containerd.UnmountAll(dir) {
			t.Logf("cluster: %v", err)
		}
		os.RemoveAll(dir)
	}
	return cgroups
}

// containerLogLinks is where the kubelet links every container's log,
// whatever its root directory: a fixed path.
const containerLogLinks = "/var/log/containers"

// removeContainerLogLinks removes the kubelet's links to logs under dir
// (the directory itself stays: other kubelets may use it).
func removeContainerLogLinks(dir string) {
	links, _ := filepath.Glob(filepath.Join(containerLogLinks, "*.log"))
	for _, l := range links {
		if target, err := os.Readlink(l); err == nil && strings.HasPrefix(target, dir+"/") {
			os.Remove(l)
		}
	}
}

func processIs(pid int, name string) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	return err == nil && strings.HasPrefix(name, strings.TrimSpace(string(b)))
}
