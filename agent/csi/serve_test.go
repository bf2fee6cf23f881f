package csi

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	registerpb "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// recordingPublisher is the agent's stand-in: it records what it was asked
// and answers with err, or panics.
type recordingPublisher struct {
	mu          sync.Mutex
	published   []Publication
	unpublished []string
	err         error
	panics      bool
}

func (r *recordingPublisher) Publish(_ context.Context, p Publication) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.panics {
		panic("a bug in the agent's publish")
	}
	r.published = append(r.published, p)
	return r.err
}

func (r *recordingPublisher) Unpublish(_ context.Context, volumeID, _ string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.unpublished = append(r.unpublished, volumeID)
	return r.err
}

func (r *recordingPublisher) calls() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.published)
}

type plugin struct {
	kubeletDir string
	pub        *recordingPublisher
	done       chan error
	cancel     context.CancelFunc
}

// startPlugin serves the plugin in a temporary kubelet directory, the way
// the agent does, and stops it when the test ends.
func startPlugin(t *testing.T) *plugin {
	t.Helper()
	// Not t.TempDir(): a socket's path has at most 107 bytes, and the test's
	// name is in t.TempDir's.
	dir, err := os.MkdirTemp("", "csi")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	p := &plugin{kubeletDir: dir, pub: &recordingPublisher{}, done: make(chan error, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	go func() {
		p.done <- Serve(ctx, Config{KubeletDir: p.kubeletDir, NodeID: "node-1", Version: "test", Publisher: p.pub})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-p.done:
		case <-time.After(30 * time.Second):
			t.Error("the plugin did not stop")
		}
	})
	waitForSocket(t, RegistrationSocketPath(p.kubeletDir), p.done)
	return p
}

func waitForSocket(t *testing.T, path string, done chan error) {
	t.Helper()
	for {
		if fi, err := os.Stat(path); err == nil && fi.Mode().Type() == os.ModeSocket {
			return
		}
		select {
		case err := <-done:
			done <- err // for the cleanup
			t.Fatalf("the plugin stopped before it listened: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func dial(t *testing.T, sock string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// The kubelet's view: the registration socket names the driver and the CSI
// socket, and that socket answers Identity and Node.
func TestPluginRegistersAndServes(t *testing.T) {
	p := startPlugin(t)
	ctx := callCtx(t)
	info, err := registerpb.NewRegistrationClient(dial(t, RegistrationSocketPath(p.kubeletDir))).GetInfo(ctx, &registerpb.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.Type != registerpb.CSIPlugin || info.Name != DriverName || info.Endpoint != SocketPath(p.kubeletDir) {
		t.Fatalf("registration info %+v", info)
	}
	if fi, err := os.Stat(info.Endpoint); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("the CSI socket: %v %v (want mode 0600)", fi, err)
	}
	conn := dial(t, info.Endpoint)
	pi, err := csipb.NewIdentityClient(conn).GetPluginInfo(ctx, &csipb.GetPluginInfoRequest{})
	if err != nil || pi.Name != DriverName {
		t.Fatalf("plugin info %v %v", pi, err)
	}
	probe, err := csipb.NewIdentityClient(conn).Probe(ctx, &csipb.ProbeRequest{})
	if err != nil || !probe.GetReady().GetValue() {
		t.Fatalf("probe %v %v", probe, err)
	}
	ni, err := csipb.NewNodeClient(conn).NodeGetInfo(ctx, &csipb.NodeGetInfoRequest{})
	if err != nil || ni.NodeId != "node-1" {
		t.Fatalf("node info %v %v", ni, err)
	}
	req := goodPublish()
	req.TargetPath = filepath.Join(p.kubeletDir, "pods", testUID, "volumes/kubernetes.io~csi/ram/mount")
	if _, err := csipb.NewNodeClient(conn).NodePublishVolume(ctx, req); err != nil {
		t.Fatal(err)
	}
	if p.pub.calls() != 1 || p.pub.published[0].Target != req.TargetPath || p.pub.published[0].Pod.Namespace != "team-a" {
		t.Fatalf("the publisher got %+v", p.pub.published)
	}
	if _, err := csipb.NewNodeClient(conn).NodeUnpublishVolume(ctx, &csipb.NodeUnpublishVolumeRequest{VolumeId: testVolID, TargetPath: req.TargetPath}); err != nil {
		t.Fatal(err)
	}
	if len(p.pub.unpublished) != 1 || p.pub.unpublished[0] != testVolID {
		t.Fatalf("unpublished %v", p.pub.unpublished)
	}
}

// A refused request never reaches the publisher, and its status is final
// (InvalidArgument) with vmsnap's code in the message, so the pod's events
// say what to change.
func TestPublishRefusalsAreFinalAndNeverReachThePublisher(t *testing.T) {
	p := startPlugin(t)
	node := csipb.NewNodeClient(dial(t, SocketPath(p.kubeletDir)))
	req := goodPublish()
	req.VolumeContext[AttrImage] = "registry.example/vms/state:latest"
	_, err := node.NodePublishVolume(callCtx(t), req)
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "USAGE") || !strings.Contains(err.Error(), "by digest") {
		t.Fatalf("got %v", err)
	}
	if p.pub.calls() != 0 {
		t.Fatal("the publisher was called for a refused request")
	}
}

// What may pass (the registry, a full node) is retried by the kubelet;
// what the pod must change is not.
func TestPublisherErrorsMapToRetryableOrFinal(t *testing.T) {
	p := startPlugin(t)
	node := csipb.NewNodeClient(dial(t, SocketPath(p.kubeletDir)))
	for _, c := range []struct {
		err  error
		want codes.Code
	}{
		{errcode.New(errcode.RegistryError, "the registry did not answer"), codes.Unavailable},
		{errcode.New(errcode.Busy, "slots taken"), codes.Unavailable},
		{errcode.New(errcode.Forbidden, "repository not allowed"), codes.PermissionDenied},
		{errcode.New(errcode.DigestMismatch, "bad blob"), codes.FailedPrecondition},
		{errors.New("unexpected"), codes.Internal},
	} {
		p.pub.err = c.err
		req := goodPublish()
		req.TargetPath = filepath.Join(p.kubeletDir, "pods", testUID, "volumes/kubernetes.io~csi/ram/mount")
		_, err := node.NodePublishVolume(callCtx(t), req)
		if status.Code(err) != c.want {
			t.Errorf("%v: got %v, want %v", c.err, err, c.want)
		}
	}
}

// A bug in the agent's publish answers that call with Internal; the plugin
// keeps serving.
func TestAPanickingPublishDoesNotStopThePlugin(t *testing.T) {
	p := startPlugin(t)
	conn := dial(t, SocketPath(p.kubeletDir))
	req := goodPublish()
	req.TargetPath = filepath.Join(p.kubeletDir, "pods", testUID, "volumes/kubernetes.io~csi/ram/mount")
	p.pub.panics = true
	_, err := csipb.NewNodeClient(conn).NodePublishVolume(callCtx(t), req)
	if status.Code(err) != codes.Internal {
		t.Fatalf("got %v", err)
	}
	p.pub.panics = false
	if _, err := csipb.NewNodeClient(conn).NodePublishVolume(callCtx(t), req); err != nil {
		t.Fatalf("after the panic: %v", err)
	}
}

// An oversized request is refused before the handler sees it.
func TestOversizedRequestIsRefused(t *testing.T) {
	p := startPlugin(t)
	req := goodPublish()
	req.Secrets = map[string]string{"x": strings.Repeat("s", 2*maxMessage)}
	_, err := csipb.NewNodeClient(dial(t, SocketPath(p.kubeletDir))).NodePublishVolume(callCtx(t), req)
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("got %v", err)
	}
	if p.pub.calls() != 0 {
		t.Fatal("the publisher was called")
	}
}

// A refused registration stops the plugin with an error, so that the agent
// restarts and the kubelet tries again.
func TestRefusedRegistrationStopsThePlugin(t *testing.T) {
	p := startPlugin(t)
	reg := registerpb.NewRegistrationClient(dial(t, RegistrationSocketPath(p.kubeletDir)))
	if _, err := reg.NotifyRegistrationStatus(callCtx(t), &registerpb.RegistrationStatus{PluginRegistered: false, Error: "version 0.9 not supported"}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-p.done:
		if err == nil || !strings.Contains(err.Error(), "version 0.9 not supported") {
			t.Fatalf("Serve returned %v", err)
		}
		p.done <- err // for the cleanup
	case <-time.After(30 * time.Second):
		t.Fatal("the plugin kept serving after the kubelet refused it")
	}
	if _, err := os.Lstat(SocketPath(p.kubeletDir)); !os.IsNotExist(err) {
		t.Fatalf("the CSI socket is still there: %v", err)
	}
}

// Something at the socket's path that is not a socket is never removed.
func TestServeLeavesANonSocketAlone(t *testing.T) {
	dir := t.TempDir()
	sock := SocketPath(dir)
	if err := os.MkdirAll(filepath.Dir(sock), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(sock, []byte("precious"), 0o600); err != nil {
		t.Fatal(err)
	}
	err := Serve(context.Background(), Config{KubeletDir: dir, NodeID: "n", Publisher: &recordingPublisher{}})
	if err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Fatalf("got %v", err)
	}
	if b, _ := os.ReadFile(sock); string(b) != "precious" {
		t.Fatal("the file was replaced")
	}
}

// A peer that is not root is closed at accept even when the socket's mode
// was loosened: the publisher is never called.
func TestNonRootPeerIsRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIP: needs root to run a peer as another user (CI runs as root)")
	}
	p := startPlugin(t)
	sock := SocketPath(p.kubeletDir)
	// Loosen everything a careless admin could: the directories and the socket.
	for _, d := range []string{p.kubeletDir, filepath.Dir(filepath.Dir(sock)), filepath.Dir(sock)} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(sock, 0o666); err != nil {
		t.Fatal(err)
	}
	// The test binary, where the other user can run it.
	bin := filepath.Join(p.kubeletDir, "peer.test")
	exe, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, exe, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-test.run=^TestHelperPublishAsPeer$")
	cmd.Env = append(os.Environ(), "VMSNAP_CSI_PEER_SOCKET="+sock, "VMSNAP_CSI_PEER_TARGET="+filepath.Join(p.kubeletDir, "pods", testUID, "volumes/kubernetes.io~csi/ram/mount"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("peer: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "code=Unavailable") {
		t.Fatalf("the non-root peer was not refused:\n%s", out)
	}
	if p.pub.calls() != 0 {
		t.Fatal("the publisher was called for a non-root peer")
	}
}

// TestHelperPublishAsPeer is the non-root peer of TestNonRootPeerIsRefused.
func TestHelperPublishAsPeer(t *testing.T) {
	sock := os.Getenv("VMSNAP_CSI_PEER_SOCKET")
	if sock == "" {
		t.Skip("SKIP: runs only as TestNonRootPeerIsRefused's child process")
	}
	req := goodPublish()
	req.TargetPath = os.Getenv("VMSNAP_CSI_PEER_TARGET")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := csipb.NewNodeClient(dial(t, sock)).NodePublishVolume(ctx, req)
	fmt.Printf("code=%v err=%v\n", status.Code(err), err)
}
