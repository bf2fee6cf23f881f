package main

import (
	"context"

	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/agent/mounter"
)

const mounterLong = `Run the privileged part of vmsnap's CSI node plugin, on its own in a
privileged container (the agent keeps its usual privileges). It has one job:
on the node agent's request, bind-mount a publication directory the agent
prepared and verified onto a kubelet CSI volume target, and unmount it. It also
keeps a duplicate of the node's /dev/fuse descriptor, so that either the agent
or the mounter can restart without ending the FUSE connection.

It makes no network connection and reads no image. It answers only root (and,
with --agent-gid, only that group) on a unix socket in a directory of root's
alone. A target must be --kubelet-pods-dir/POD_UID/volumes/kubernetes.io~csi/
VOLUME/mount of the requesting pod, with the kubelet's volume id for it; a
source must be a directory named after that volume id below a
--publication-root. Both are opened beneath their roots without following
links, and the mount is made onto the opened directory, so a name swapped in
meanwhile cannot redirect it. Every publication is nosuid, nodev and noexec.`

func newMounterCmd() *cobra.Command {
	var logLevel string
	cfg := mounter.Config{}
	c := &cobra.Command{
		Use:   "mounter --socket PATH --publication-root DIR",
		Short: "Run the node plugin's mounter: bind the agent's publications onto kubelet volume targets",
		Long:  mounterLong,
		Args:  cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			return coded(runMounter(c.Context(), cfg, logLevel))
		},
	}
	c.Flags().StringVar(&cfg.Socket, "socket", "/run/vmsnap/node/mounter.sock",
		"unix socket the agent connects to; its directory must be root's alone (mode 0700), and is made so if missing")
	c.Flags().StringVar(&cfg.PodsDir, "kubelet-pods-dir", mounter.DefaultPodsDir, "the kubelet's pods directory: every target is below it")
	c.Flags().StringArrayVar(&cfg.PublicationRoots, "publication-root", []string{"/run/vmsnap/fuse", "/var/lib/vmsnap/ram"},
		"directory the agent prepares publications in (repeatable): every source is below one")
	c.Flags().IntVar(&cfg.AgentGID, "agent-gid", -1, "gid the agent runs with: callers must have it as well as uid 0 (-1: any gid)")
	c.Flags().StringVar(&logLevel, "log-level", "info", "debug, info, warn or error (JSON logs on stderr)")
	return c
}

func runMounter(ctx context.Context, cfg mounter.Config, logLevel string) error {
	log, err := newLogger(logLevel)
	if err != nil {
		return err
	}
	cfg.Log = log
	srv, err := mounter.New(cfg)
	if err != nil {
		return err
	}
	log.Info("mounter ready", "socket", cfg.Socket, "podsDir", cfg.PodsDir, "publicationRoots", cfg.PublicationRoots)
	return srv.Serve(ctx)
}
