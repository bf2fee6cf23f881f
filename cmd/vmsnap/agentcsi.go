package main

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"golang.org/x/sync/errgroup"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/agent/csi"
	"github.com/vmsnap/vmsnap/agent/mounter"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// agentCSIFlags run the agent's CSI node plugin (agent/csi) beside its API.
type agentCSIFlags struct {
	kubeletDir, nodeName, mounterSocket string
}

func (f *agentCSIFlags) add(c *cobra.Command) {
	c.Flags().StringVar(&f.kubeletDir, "csi-kubelet-dir", "",
		"the kubelet's root directory (/var/lib/kubelet), at the same path in the agent's container: serve the CSI node plugin "+csi.DriverName+
			" there (its socket under plugins/, its registration under plugins_registry/); \"\": no CSI plugin")
	c.Flags().StringVar(&f.nodeName, "node-name", "", "this node's name, for the CSI plugin (default: $NODE_NAME, which the manifests set from the downward API)")
	c.Flags().StringVar(&f.mounterSocket, "mounter-socket", "/run/vmsnap/node/mounter.sock", "socket of this node's vmsnap mounter, which mounts the CSI plugin's publications")
}

// check completes and checks the flags before the agent starts.
func (f *agentCSIFlags) check() error {
	if f.kubeletDir == "" {
		return nil
	}
	if !filepath.IsAbs(f.kubeletDir) {
		return errcode.New(errcode.Usage, "--csi-kubelet-dir %q: give the kubelet's root directory as an absolute path", f.kubeletDir)
	}
	if f.nodeName == "" {
		f.nodeName = os.Getenv("NODE_NAME")
	}
	if f.nodeName == "" {
		return errcode.New(errcode.Usage, "--csi-kubelet-dir needs the node's name: give --node-name, or NODE_NAME from the downward API (spec.nodeName)")
	}
	return nil
}

// serve runs srv's API, and the CSI plugin when asked, until ctx ends or
// either fails (which stops the other).
func (f *agentCSIFlags) serve(ctx context.Context, srv *agent.Server, log *slog.Logger) error {
	if f.kubeletDir == "" {
		return srv.Serve(ctx)
	}
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return srv.Serve(ctx) })
	g.Go(func() error {
		return csi.Serve(ctx, csi.Config{KubeletDir: f.kubeletDir, NodeID: f.nodeName, Version: version,
			Publisher: srv.CSIPublisher(mounter.Client{Socket: f.mounterSocket}), Log: log})
	})
	return g.Wait()
}
