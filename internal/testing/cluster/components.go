package cluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Service CIDR of the cluster: addresses the apiserver hands out to
// Services. Nothing routes them (there is no kube-proxy); vmsnap needs none.
const serviceCIDR = "10.96.0.0/24"

// startControlPlane runs etcd and the apiserver, waits for /readyz, then
// runs the controller manager and the scheduler (started earlier, they
// spend their first seconds failing to reach it).
func (c *Cluster) startControlPlane(t testing.TB) error {
	pkiDir := filepath.Join(c.Dir, "pki")
	if err := os.MkdirAll(pkiDir, 0o700); err != nil {
		return err
	}
	p, err := newPKI(pkiDir)
	if err != nil {
		return err
	}
	c.CAFile, c.pki = p.CAFile, p
	ports, err := freePorts(5)
	if err != nil {
		return err
	}
	etcdClient, etcdPeer, apiPort, cmPort, schedPort := ports[0], ports[1], ports[2], ports[3], ports[4]
	client := fmt.Sprintf("http://127.0.0.1:%d", etcdClient)
	peer := fmt.Sprintf("http://127.0.0.1:%d", etcdPeer)
	if _, err := c.run("etcd", etcdBinary, "--name", "test", "--data-dir", filepath.Join(c.Dir, "etcd"),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "test="+peer, "--log-level", "warn"); err != nil {
		return err
	}

	server := fmt.Sprintf("https://127.0.0.1:%d", apiPort)
	servingCert, servingKey, err := p.issue("apiserver", "kube-apiserver", nil,
		"127.0.0.1", c.NodeIP, "10.96.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc")
	if err != nil {
		return err
	}
	kubeletClientCert, kubeletClientKey, err := p.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", []string{"system:masters"})
	if err != nil {
		return err
	}
	saPub, saKey, err := p.serviceAccountKey()
	if err != nil {
		return err
	}
	if _, err := c.run("kube-apiserver", filepath.Join(c.bin, "kube-apiserver"),
		"--etcd-servers", client,
		"--bind-address", "127.0.0.1", "--advertise-address", c.NodeIP, "--secure-port", strconv.Itoa(apiPort),
		"--tls-cert-file", servingCert, "--tls-private-key-file", servingKey,
		"--client-ca-file", p.CAFile,
		"--service-account-key-file", saPub, "--service-account-signing-key-file", saKey,
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-cluster-ip-range", serviceCIDR,
		"--authorization-mode", "Node,RBAC",
		// PodSecurity is on by default; named so that no default change
		// can drop it from under the tests that rely on it.
		"--enable-admission-plugins", "NodeRestriction,PodSecurity",
		"--allow-privileged=true",
		"--kubelet-client-certificate", kubeletClientCert, "--kubelet-client-key", kubeletClientKey,
		// Logs and exec go to the node's InternalIP: its hostname does
		// not resolve.
		"--kubelet-preferred-address-types", "InternalIP,Hostname",
		"--profiling=false", "--v=1"); err != nil {
		return err
	}
	if c.Kubeconfig, err = p.kubeconfig("admin", server, "vmsnap-test-admin", "system:masters"); err != nil {
		return err
	}
	if err := c.connect(); err != nil {
		return err
	}
	if err := c.waitFor("the apiserver's /readyz", startupWait, func() (bool, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := c.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err == nil, err
	}); err != nil {
		return err
	}

	cmConfig, err := p.kubeconfig("controller-manager", server, "system:kube-controller-manager")
	if err != nil {
		return err
	}
	if _, err := c.run("kube-controller-manager", filepath.Join(c.bin, "kube-controller-manager"),
		"--kubeconfig", cmConfig, "--authentication-kubeconfig", cmConfig, "--authorization-kubeconfig", cmConfig,
		"--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(cmPort),
		"--leader-elect=false", "--use-service-account-credentials=true",
		"--service-account-private-key-file", saKey, "--root-ca-file", p.CAFile,
		"--cluster-signing-cert-file", p.CAFile, "--cluster-signing-key-file", filepath.Join(pkiDir, "ca.key"),
		"--profiling=false", "--v=1"); err != nil {
		return err
	}
	schedConfig, err := p.kubeconfig("scheduler", server, "system:kube-scheduler")
	if err != nil {
		return err
	}
	_, err = c.run("kube-scheduler", filepath.Join(c.bin, "kube-scheduler"),
		"--kubeconfig", schedConfig, "--authentication-kubeconfig", schedConfig, "--authorization-kubeconfig", schedConfig,
		"--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(schedPort),
		"--leader-elect=false", "--profiling=false", "--v=1")
	return err
}

// startKubelet runs the kubelet and waits until its node is Ready.
func (c *Cluster) startKubelet(t testing.TB) error {
	kubeconfig, err := c.pki.kubeconfig("kubelet", c.Config.Host, "system:node:"+c.NodeName, "system:nodes")
	if err != nil {
		return err
	}
	ports, err := freePorts(2)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(c.KubeletRoot, 0o750); err != nil {
		return err
	}
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroups are v1 here and PID 1 is not systemd.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: %q
containerRuntimeEndpoint: unix://%s
address: %q
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
podLogsDir: %q
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %q}
authorization:
  mode: Webhook
failSwapOn: false
# The node's disk and memory are shared with the rest of the machine:
# nothing this cluster runs may be evicted or garbage-collected because of
# what others use.
evictionHard: {memory.available: "1Mi", nodefs.available: "1Mi", imagefs.available: "1Mi", nodefs.inodesFree: "1"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
resolvConf: ""
maxPods: 50
nodeStatusReportFrequency: 10s
syncFrequency: 5s
fileCheckFrequency: 5s
`, c.cgroupRoot(), c.Containerd.Address, c.NodeIP, ports[0], ports[1],
		filepath.Join(c.Dir, "pod-logs"), c.CAFile)
	cfgPath := filepath.Join(c.Dir, "kubelet.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		return err
	}
	if _, err := c.run("kubelet", filepath.Join(c.bin, "kubelet"),
		"--config", cfgPath, "--kubeconfig", kubeconfig,
		"--root-dir", c.KubeletRoot, "--cert-dir", filepath.Join(c.KubeletRoot, "pki"),
		"--hostname-override", c.NodeName, "--node-ip", c.NodeIP, "--v=1"); err != nil {
		return err
	}
	return c.waitFor("node "+c.NodeName+" Ready", startupWait, c.nodeReady)
}

// waitDefaultServiceAccount waits until the controller manager made the
// default ServiceAccount of namespace: pods cannot be created before.
func (c *Cluster) waitDefaultServiceAccount(ns string) error {
	return c.waitFor("ServiceAccount default in "+ns, time.Minute, func() (bool, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := c.Client.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, err
	})
}
