package agent

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

// csiNode is a node without a cluster: a kubelet directory under a short
// temporary path, the real mounter in this process, the agent's CSI plugin
// on its real sockets, and a CSI client that calls it as the kubelet does.
type csiNode struct {
	kubelet string
	node    csipb.NodeClient
}

func startCSINode(t *testing.T, srv *Server) *csiNode {
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
		PublicationRoots: []string{filepath.Join(srv.cfg.StateDir, "ram")}, AgentGID: -1, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	mdone, cdone := make(chan error, 1), make(chan error, 1)
	go func() { mdone <- m.Serve(ctx) }()
	go func() {
		cdone <- csi.Serve(ctx, csi.Config{KubeletDir: kubelet, NodeID: "node-1", Version: "test",
			Publisher: srv.CSIPublisher(mounter.Client{Socket: filepath.Join(dir, "run", "mounter.sock")}), Log: log})
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
	return &csiNode{kubelet: kubelet, node: csipb.NewNodeClient(conn)}
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

// csiVolume is one pod's inline volume, as the kubelet names it.
type csiVolume struct {
	id, target, podUID string
}

// newVolume is a new pod's volume "ram": the kubelet makes the target's
// parent, the plugin (the mounter) the target.
func (n *csiNode) newVolume(t *testing.T) csiVolume {
	t.Helper()
	b := make([]byte, 16)
	rand.Read(b)
	h := hex.EncodeToString(b)
	uid := h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
	v := csiVolume{id: mounter.VolumeHandle(uid, "ram"), podUID: uid,
		target: filepath.Join(n.kubelet, "pods", uid, "volumes", "kubernetes.io~csi", "ram", "mount")}
	if err := os.MkdirAll(filepath.Dir(v.target), 0o750); err != nil {
		t.Fatal(err)
	}
	// Whatever the test does, no mount outlives it.
	t.Cleanup(func() { unix.Unmount(v.target, unix.MNT_DETACH) })
	return v
}

// publish calls NodePublishVolume as the kubelet does for a pod of
// namespace ns whose volume names image.
func (n *csiNode) publish(v csiVolume, ns, image string) error {
	_, err := n.node.NodePublishVolume(context.Background(), &csipb.NodePublishVolumeRequest{
		VolumeId: v.id, TargetPath: v.target, Readonly: true,
		VolumeCapability: &csipb.VolumeCapability{AccessType: &csipb.VolumeCapability_Mount{Mount: &csipb.VolumeCapability_MountVolume{}},
			AccessMode: &csipb.VolumeCapability_AccessMode{Mode: csipb.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY}},
		VolumeContext: map[string]string{
			csi.AttrImage:                            image,
			"csi.storage.k8s.io/pod.name":            "restore-" + v.podUID[:8],
			"csi.storage.k8s.io/pod.namespace":       ns,
			"csi.storage.k8s.io/pod.uid":             v.podUID,
			"csi.storage.k8s.io/serviceAccount.name": "default",
			"csi.storage.k8s.io/ephemeral":           "true",
		},
	})
	return err
}

func (n *csiNode) unpublish(v csiVolume) error {
	_, err := n.node.NodeUnpublishVolume(context.Background(), &csipb.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target})
	return err
}
