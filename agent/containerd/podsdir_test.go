package containerd

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/internal/errcode"
	testcontainerd "github.com/vmsnap/vmsnap/internal/testing/containerd"
)

// With WithPodsDir, a VM's files are opened only on volumes in the
// kubelet's directory of that very pod. A tenant whose pod mounts another
// pod's volume, or any directory of the node, as a hostPath volume (its
// pod spec is the tenant's to write) cannot make the agent open another
// VM's QMP socket or a node file as its own VM's.
func TestResolverOpensOnlyThePodsOwnVolumes(t *testing.T) {
	d := testcontainerd.Start(t)
	podsDir, err := os.MkdirTemp("", "p") // short: socket paths below it must fit a sockaddr
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(podsDir) })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := New(ctx, d.Address, "", WithPodsDir(podsDir), WithLogger(testLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })

	// volume makes the kubelet's directory of an emptyDir of pod uid, with
	// a QMP socket and a disk in it.
	volume := func(uid string) string {
		dir := filepath.Join(podsDir, uid, "volumes", "kubernetes.io~empty-dir", "vm")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		listenUnix(t, filepath.Join(dir, "qmp.sock"))
		if err := os.WriteFile(filepath.Join(dir, "disk.qcow2"), []byte("QFI\xfb"), 0o600); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	victimUID, tenantUID, hostPathUID, nodeUID := testcontainerd.NewPodUID(), testcontainerd.NewPodUID(), testcontainerd.NewPodUID(), testcontainerd.NewPodUID()
	victimVol := volume(victimUID)
	d.Create(t, testcontainerd.PodContainer{PodUID: victimUID, PodNamespace: "tenant-a", Name: "qemu", HostDir: victimVol})
	d.Create(t, testcontainerd.PodContainer{PodUID: tenantUID, PodNamespace: "tenant-b", Name: "qemu", HostDir: volume(tenantUID)})
	// tenant-b's other pods: one mounts tenant-a's volume, one a node
	// directory, each as a hostPath volume.
	d.Create(t, testcontainerd.PodContainer{PodUID: hostPathUID, PodNamespace: "tenant-b", Name: "qemu", HostDir: victimVol})
	nodeDir := filepath.Join(podsDir, "..", filepath.Base(podsDir)+"-node")
	if err := os.Mkdir(nodeDir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(nodeDir) })
	listenUnix(t, filepath.Join(nodeDir, "qmp.sock"))
	if err := os.WriteFile(filepath.Join(nodeDir, "disk.qcow2"), []byte("the node's secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	d.Create(t, testcontainerd.PodContainer{PodUID: nodeUID, PodNamespace: "tenant-b", Name: "qemu", HostDir: nodeDir})

	ref := func(uid string) agent.VMRef {
		return agent.VMRef{PodUID: uid, Container: "qemu", QMPPath: "/run/vm/qmp.sock", DiskPath: "/run/vm/disk.qcow2"}
	}
	for _, uid := range []string{victimUID, tenantUID} {
		if tg, _, err := resolve(t, r, ref(uid)); err != nil || filepath.Dir(tg.QMPPath) != filepath.Join(podsDir, uid, "volumes", "kubernetes.io~empty-dir", "vm") {
			t.Errorf("a pod's own emptyDir: %+v, %v", tg, err)
		}
	}
	for what, uid := range map[string]string{"another pod's volume": hostPathUID, "a node directory": nodeUID} {
		if _, _, err := resolve(t, r, ref(uid)); errcode.Of(err) != errcode.Forbidden {
			t.Errorf("%s as a hostPath volume: %v, want FORBIDDEN", what, err)
		}
		if _, _, err := resolve(t, r, agent.VMRef{PodUID: uid, Container: "qemu", QMPPath: "/run/vm/qmp.sock"}); errcode.Of(err) != errcode.Forbidden {
			t.Errorf("%s as a hostPath volume, the QMP socket alone: %v, want FORBIDDEN", what, err)
		}
	}

	// Without WithPodsDir (a node whose VMs use hostPath volumes on
	// purpose), the volume's source is not checked.
	open, err := New(ctx, d.Address, "", WithLogger(testLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { open.Close() })
	if _, _, err := resolve(t, open, ref(nodeUID)); err != nil {
		t.Errorf("without WithPodsDir: %v", err)
	}
}
