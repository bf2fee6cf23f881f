package main

import (
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Every option the cluster needs is a flag of vmsnap manifests, and ends up
// in the objects: node paths, the registry CA, the agent's policy, and the
// restored pod's launcher.
func TestManifestsFlags(t *testing.T) {
	out, code := cli(t, "manifests", "--part", "agent", "--omit-namespace", "--image", "vmsnap.test/vmsnap:e2e",
		"--containerd-socket", "/run/k3s/containerd/containerd.sock", "--containerd-root", "/var/lib/rancher/k3s/agent/containerd",
		"--kubelet-pods-dir", "/srv/kubelet/pods", "--registry-ca-configmap", "registry-ca",
		"--allow-repository", "10.0.0.5:5000/vms", "--allow-repository", "10.0.0.5:5000/more",
		"--admin-namespace", "vm-ctl", "--layout-root", "/srv/layouts", "--operation-timeout", "5m", "--max-workers", "3")
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	docs := strings.Split(string(out), "\n---\n")
	var ds appsv1.DaemonSet
	if err := yaml.UnmarshalStrict([]byte(docs[len(docs)-1]), &ds); err != nil || ds.Kind != "DaemonSet" {
		t.Fatalf("no DaemonSet (%v):\n%s", err, out)
	}
	c := ds.Spec.Template.Spec.Containers[0]
	want := []string{"vmsnap", "agent", "--socket", "/run/vmsnap/agent.sock", "--state-dir", "/var/lib/vmsnap",
		"--containerd-address", "/run/k3s/containerd/containerd.sock",
		"--allow-repository", "10.0.0.5:5000/vms", "--allow-repository", "10.0.0.5:5000/more",
		"--admin-namespace", "vmsnap-system", "--admin-namespace", "vm-ctl", "--layout-root", "/srv/layouts",
		"--kubelet-pods-dir", "/srv/kubelet/pods", "--operation-timeout", "5m0s", "--max-workers", "3", "--ca-file", "/etc/vmsnap/ca/ca.pem"}
	if !slices.Equal(c.Command, want) || c.Image != "vmsnap.test/vmsnap:e2e" || c.ImagePullPolicy != corev1.PullIfNotPresent {
		t.Errorf("agent %q (%s, %s), want %q", c.Command, c.Image, c.ImagePullPolicy, want)
	}
	paths := map[string]bool{}
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.HostPath != nil {
			paths[v.HostPath.Path] = true
		}
	}
	for _, p := range []string{"/run/k3s/containerd/containerd.sock", "/var/lib/rancher/k3s/agent/containerd", "/srv/kubelet/pods", "/srv/layouts"} {
		if !paths[p] {
			t.Errorf("no host path %s in %v", p, paths)
		}
	}

	out, code = cli(t, "manifests", "--part", "restore", "--on-restart", "fail", "--base-dir", "/images")
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	for _, s := range []string{"- --on-restart\n    - fail\n", "- /images/${BACKING_FILE}\n", "args: ${QEMU_ARGS}\n"} {
		if !strings.Contains(string(out), s) {
			t.Errorf("the restore part lacks %q:\n%s", s, out)
		}
	}
	if out, code := cli(t, "manifests", "--part", "restore", "--restore-via-agent"); code != 0 || !strings.Contains(string(out), "- launch\n    - --defer\n") {
		t.Errorf("--restore-via-agent: exit %d, no launch --defer:\n%s", code, out)
	}
	if _, code := cli(t, "manifests", "--part", "restore", "--on-restart", "reload"); code != errcode.Usage.ExitStatus() {
		t.Errorf("--on-restart reload: exit %d, want USAGE", code)
	}
	if out, code := cli(t, "manifests", "--help"); code != 0 || !strings.Contains(string(out), "/var/snap/microk8s/common/run/containerd.sock") {
		t.Errorf("--help has no microk8s example (exit %d)", code)
	}
}
