package csi

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
	registerpb "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Config is the node plugin's place on the node.
type Config struct {
	// KubeletDir is the kubelet's root directory (/var/lib/kubelet), mounted
	// at the same path in the agent's container: the CSI socket's path is
	// what the kubelet dials, and the targets are under KubeletDir/pods.
	KubeletDir string
	NodeID     string // the node's name, NodeGetInfo's answer
	Version    string // vmsnap's version, GetPluginInfo's answer
	Publisher  Publisher
	Log        *slog.Logger
	// Ready says whether publishes can be served now (Probe); nil is always.
	Ready func() bool
}

// Bounds on what the kubelet's side may send: CSI requests are a few
// hundred bytes; the limits keep a confused or hostile peer from costing
// the agent memory.
const (
	maxMessage = 64 << 10
	maxStreams = 64
	// maxSocketPath is sun_path's size, with its terminating NUL.
	maxSocketPath = 108
)

// SocketPath is the CSI endpoint under kubeletDir; RegistrationSocketPath is
// the socket the kubelet's plugin watcher finds.
func SocketPath(kubeletDir string) string {
	return filepath.Join(kubeletDir, "plugins", DriverName, "csi.sock")
}

func RegistrationSocketPath(kubeletDir string) string {
	return filepath.Join(kubeletDir, "plugins_registry", DriverName+"-reg.sock")
}

// Serve serves the CSI and registration sockets until ctx ends, or until the
// kubelet refuses the registration (an error: restart to try again). It
// removes both sockets when it returns.
func Serve(ctx context.Context, cfg Config) error {
	if cfg.Publisher == nil || cfg.NodeID == "" || !filepath.IsAbs(cfg.KubeletDir) {
		return errcode.New(errcode.Usage, "the CSI node plugin needs a publisher, the node's name and the kubelet's directory as an absolute path (got %q)", cfg.KubeletDir)
	}
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	csiSock, regSock := SocketPath(cfg.KubeletDir), RegistrationSocketPath(cfg.KubeletDir)

	csiSrv := newGRPCServer(log)
	csipb.RegisterIdentityServer(csiSrv, &identity{version: cfg.Version, ready: cfg.Ready})
	csipb.RegisterNodeServer(csiSrv, &node{nodeID: cfg.NodeID, podsDir: filepath.Join(cfg.KubeletDir, "pods"), pub: cfg.Publisher, log: log})
	regSrv := newGRPCServer(log)
	registerpb.RegisterRegistrationServer(regSrv, &registration{endpoint: csiSock, log: log, failed: func(reason string) {
		cancel(errcode.New(errcode.Internal, "the kubelet refused the CSI node plugin %s: %s", DriverName, reason))
	}})

	// The CSI socket first: the kubelet dials it as soon as it has read the
	// registration socket's answer.
	csiLn, err := listenUnix(csiSock)
	if err != nil {
		return err
	}
	defer os.Remove(csiSock)
	regLn, err := listenUnix(regSock)
	if err != nil {
		csiLn.Close()
		return err
	}
	defer os.Remove(regSock)
	errs := make(chan error, 2)
	go func() { errs <- csiSrv.Serve(csiLn) }()
	go func() { errs <- regSrv.Serve(regLn) }()
	select {
	case <-ctx.Done():
	case err = <-errs:
		cancel(err)
	}
	// Both drain: the registration's answer to a refusal, and publishes
	// under way, are let finish for a while.
	stopGracefully(regSrv, 10*time.Second)
	stopGracefully(csiSrv, 10*time.Second)
	if err := context.Cause(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

func newGRPCServer(log *slog.Logger) *grpc.Server {
	return grpc.NewServer(
		grpc.MaxRecvMsgSize(maxMessage),
		grpc.MaxConcurrentStreams(maxStreams),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: 5 * time.Minute}),
		grpc.UnaryInterceptor(recoverUnary(log)),
	)
}

// recoverUnary turns a panic in a handler into an INTERNAL answer for that
// call: the agent, its other publications and its VMs go on.
func recoverUnary(log *slog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (resp any, err error) {
		defer func() {
			if v := recover(); v != nil {
				rerr := errcode.Recovered(v)
				log.Error("csi: recovered from a bug in "+info.FullMethod, "err", rerr)
				log.Debug("csi: stack of the bug in "+info.FullMethod, "stack", string(debug.Stack()))
				resp, err = nil, grpcError(rerr)
			}
		}()
		return h(ctx, req)
	}
}

// stopGracefully lets calls under way finish for a while (a publish may be
// fetching), then cuts them: the kubelet retries what did not finish.
func stopGracefully(s *grpc.Server, wait time.Duration) {
	done := make(chan struct{})
	go func() { s.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(wait):
		s.Stop()
	}
}

// listenUnix listens on a root-only socket at p, replacing a socket a
// previous agent left (never anything else that is there).
func listenUnix(p string) (net.Listener, error) {
	if len(p) >= maxSocketPath {
		return nil, errcode.New(errcode.Usage, "the socket path %s is %d bytes long; a unix socket's path has at most %d: give a shorter kubelet directory", p, len(p), maxSocketPath-1)
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "the CSI socket's directory")
	}
	if fi, err := os.Lstat(p); err == nil {
		if fi.Mode().Type() != os.ModeSocket {
			return nil, errcode.New(errcode.Internal, "%s exists and is not a socket: remove it by hand if it is stale", p)
		}
		if err := os.Remove(p); err != nil {
			return nil, errcode.Wrap(errcode.Internal, err, "removing the stale socket %s", p)
		}
	}
	ln, err := net.Listen("unix", p)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "listening on %s", p)
	}
	if err := os.Chmod(p, 0o600); err != nil {
		ln.Close()
		return nil, errcode.Wrap(errcode.Internal, err, "restricting %s to root", p)
	}
	return rootPeersOnly{ln.(*net.UnixListener)}, nil
}
