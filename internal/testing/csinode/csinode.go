// Package csinode is a node without a cluster for tests of vmsnap's CSI
// path: a kubelet directory under a short temporary path, the real mounter
// in the test's process, the CSI plugin on its real sockets with the
// caller's Publisher, and a CSI client that calls it as the kubelet does.
// It needs root (bind mounts) and skips loudly otherwise.
package csinode

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/vmsnap/vmsnap/agent/csi"
	"github.com/vmsnap/vmsnap/agent/mounter"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

// Node is a running node plugin and its client.
type Node struct {
	kubelet string
	node    csipb.NodeClient
}

// Publisher makes the plugin's Publisher once the mounter listens on
// socket.
type Publisher func(mounterSocket string) csi.Publisher

// Start runs the mounter, with publicationRoot its one publication root,
// and the plugin with the Publisher pub makes, until the test ends.
func Start(t *testing.T, publicationRoot string, pub Publisher) *Node {
	t.Helper()
	if os.Geteuid() != 0 {
		guest.SkipOrFail(t, "CSI publication", "the mounter's bind mounts need root")
	}
	dir, err := os.MkdirTemp("", "vmsnap-csi-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	kubelet := filepath.Join(dir, "kubelet")
	if err := os.MkdirAll(filepath.Join(kubelet, "pods"), 0o750); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	m, err := mounter.New(mounter.Config{Socket: filepath.Join(dir, "run", "mounter.sock"), PodsDir: filepath.Join(kubelet, "pods"),
		PublicationRoots: []string{publicationRoot}, AgentGID: -1, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	mdone, cdone := make(chan error, 1), make(chan error, 1)
	go func() { mdone <- m.Serve(ctx) }()
	go func() {
		cdone <- csi.Serve(ctx, csi.Config{KubeletDir: kubelet, NodeID: "node-1", Version: "test",
			Publisher: pub(filepath.Join(dir, "run", "mounter.sock")), Log: log})
	}()
	t.Cleanup(func() {
		cancel()
		<-cdone
		<-mdone
	})
	waitForSocket(t, csi.SocketPath(kubelet))
	conn, err := grpc.NewClient("unix://"+csi.SocketPath(kubelet), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &Node{kubelet: kubelet, node: csipb.NewNodeClient(conn)}
}

func waitForSocket(t *testing.T, p string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if fi, err := os.Lstat(p); err == nil && fi.Mode().Type() == os.ModeSocket {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the CSI plugin did not listen on %s", p)
		}
	}
}

// Volume is one pod's inline volume, as the kubelet names it.
type Volume struct {
	ID, Target, PodUID string
}

// NewVolume is a new pod's volume "ram": the kubelet makes the target's
// parent, the plugin (the mounter) the target.
func (n *Node) NewVolume(t *testing.T) Volume {
	t.Helper()
	b := make([]byte, 16)
	rand.Read(b)
	h := hex.EncodeToString(b)
	uid := h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
	v := Volume{ID: mounter.VolumeHandle(uid, "ram"), PodUID: uid,
		Target: filepath.Join(n.kubelet, "pods", uid, "volumes", "kubernetes.io~csi", "ram", "mount")}
	if err := os.MkdirAll(filepath.Dir(v.Target), 0o750); err != nil {
		t.Fatal(err)
	}
	// Whatever the test does, no mount outlives it.
	t.Cleanup(func() { unix.Unmount(v.Target, unix.MNT_DETACH) })
	return v
}

// Publish calls NodePublishVolume as the kubelet does for a pod of
// namespace ns whose volume names image.
func (n *Node) Publish(v Volume, ns, image string) error {
	_, err := n.node.NodePublishVolume(context.Background(), &csipb.NodePublishVolumeRequest{
		VolumeId: v.ID, TargetPath: v.Target, Readonly: true,
		VolumeCapability: &csipb.VolumeCapability{AccessType: &csipb.VolumeCapability_Mount{Mount: &csipb.VolumeCapability_MountVolume{}},
			AccessMode: &csipb.VolumeCapability_AccessMode{Mode: csipb.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY}},
		VolumeContext: map[string]string{
			csi.AttrImage:                            image,
			"csi.storage.k8s.io/pod.name":            "restore-" + v.PodUID[:8],
			"csi.storage.k8s.io/pod.namespace":       ns,
			"csi.storage.k8s.io/pod.uid":             v.PodUID,
			"csi.storage.k8s.io/serviceAccount.name": "default",
			"csi.storage.k8s.io/ephemeral":           "true",
		},
	})
	return err
}

// Unpublish calls NodeUnpublishVolume as the kubelet does.
func (n *Node) Unpublish(v Volume) error {
	_, err := n.node.NodeUnpublishVolume(context.Background(), &csipb.NodeUnpublishVolumeRequest{VolumeId: v.ID, TargetPath: v.Target})
	return err
}
