package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/agent/containerd"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

func newAgentCmd(out *globalOutput) *cobra.Command {
	var f agentDaemonFlags
	cfg := &f.cfg // most flags set the daemon's configuration itself
	c := &cobra.Command{
		Use:   "agent --socket PATH --state-dir DIR",
		Short: "Run the node agent: checkpoints and restores of this node's VMs over a local API",
		Long:  agentLong,
		Args:  cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			return coded(runAgent(c.Context(), f))
		},
	}
	c.Flags().StringVar(&cfg.Socket, "socket", "/run/vmsnap/agent.sock", "unix socket of the API")
	c.Flags().StringVar(&cfg.SocketGroup, "socket-group", "", "group (name or GID) that may use the socket (default: the agent's own group)")
	c.Flags().StringVar(&cfg.StateDir, "state-dir", "/var/lib/vmsnap", "journal of unfinished operations; must survive restarts of the agent")
	c.Flags().IntVar(&cfg.MaxConcurrent, "max-concurrent", 2, "operations running at once on this node; more wait as pending")
	// Bounds on one operation (see the Long help).
	c.Flags().IntVar(&cfg.MaxWorkers, "max-workers", agent.DefaultMaxWorkers(),
		fmt.Sprintf("most workers a request may ask for: twice the CPUs by default, at most %d (each holds up to about 50 MiB)", agent.HardMaxWorkers))
	c.Flags().DurationVar(&cfg.OperationTimeout, "operation-timeout", agent.DefaultOperationTimeout,
		"longest an operation may take, from its acceptance; then it fails with the code of what it waited for and its VM is put back")

	c.Flags().IntVar(&cfg.Limits.Connections, "max-connections-per-caller", agent.DefaultMaxConnectionsPerCaller,
		"open connections one caller (a namespace's callers together) may hold, idle ones included; more are refused with BUSY")
	c.Flags().IntVar(&cfg.Limits.Streams, "max-streams-per-caller", agent.DefaultMaxStreamsPerCaller,
		"event streams one caller may hold; more are refused with BUSY (the vmsnap client then polls)")
	c.Flags().IntVar(&cfg.Limits.Operations, "max-operations-per-caller", agent.DefaultMaxOperationsPerCaller,
		"checkpoints, restores and prepares one caller may have pending or running; more are refused with BUSY")
	c.Flags().Int64Var(&cfg.RAMCacheMaxBytes, "ram-cache-max-bytes", 0,
		"bound of each namespace's RAM file cache (--state-dir/ram/NAMESPACE, filled by prepare requests), in allocated bytes, the device states kept beside the files included: "+
			"once a file is ready, the least recently used others past it are removed (QEMUs that map them keep their pages; 0: no bound)")
	c.Flags().DurationVar(&cfg.RAMCacheMaxAge, "ram-cache-max-age", 0,
		"each time a file is prepared, also remove the RAM files of its namespace's cache unused for longer than this (files a pod's CSI volume shows stay; 0: no bound)")
	c.Flags().Int64Var(&cfg.MaxGuestMemory, "max-guest-memory", 0,
		"refuse a prepare request whose image declares more guest memory than this many bytes, before fetching its layers (0: this node's memory)")

	c.Flags().StringVar(&f.containerdAddress, "containerd-address", "/run/containerd/containerd.sock", "the node's containerd socket")
	c.Flags().StringVar(&f.containerdNamespace, "containerd-namespace", "k8s.io", "containerd namespace of the kubelet's containers")
	c.Flags().StringVar(&f.podsDir, "kubelet-pods-dir", "/var/lib/kubelet/pods",
		"the kubelet's pods directory: a VM's QMP socket and disk are opened only on volumes below DIR/POD_UID (not on hostPath volumes); \"\": on any volume")
	c.Flags().StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error (JSON logs on stderr)")
	c.Flags().IntVar(&cfg.Keep, "keep", 0, "after each successful checkpoint whose request has no \"keep\", keep the `N` newest checkpoints of its state repository and delete the older ones (as vmsnap prune; 0: never prune)")
	// Authorization: who may act on which VM, and where images may go.
	c.Flags().StringArrayVar(&cfg.AdminNamespaces, "admin-namespace", nil,
		"pod namespace whose callers may act on any VM and see every operation, such as a platform controller's (repeatable)")
	c.Flags().StringArrayVar(&cfg.AllowRepositories, "allow-repository", nil,
		"HOST[:PORT]/PREFIX a request's registry images must be under: the host and port exactly, the repository PREFIX or below it "+
			"on a '/' boundary; a component {namespace} is the caller's namespace (repeatable; none: every registry image is refused)")
	c.Flags().StringVar(&cfg.LayoutRoot, "layout-root", "",
		"directory a request's oci: layouts must be under (a caller in a pod: under DIR/NAMESPACE), only the agent may write below it, "+
			"with no symbolic link below it and never overlapping --state-dir (none: every oci: layout is refused)")
	f.registry.add(c)
	f.crypt.encrypt.add(c)
	c.Flags().StringVar(&f.crypt.keyDir, "decryption-key-dir", "",
		"`DIR` of PEM private keys (a mounted Secret; each file mode 0600 or 0440): DIR/NAMESPACE/* are a namespace's, which its restores and prepares decrypt with "+
			"and its checkpoints are encrypted for; files directly in DIR are the node's, for --admin-namespace callers only; requests never carry keys")
	f.sigs.add(c)
	f.csi.add(c)
	c.AddCommand(newAgentHealthCmd())
	return c
}

// agentCryptFlags: the agent encrypts every checkpoint for the operator's
// recipients (and its namespace's keys), and decrypts with the keys of a
// mounted directory, by namespace (agent/keys.go).
type agentCryptFlags struct {
	encrypt encryptFlags
	keyDir  string
}

// agentDaemonFlags are vmsnap agent's: the daemon's configuration and what
// runAgent builds its parts from.
type agentDaemonFlags struct {
	cfg                                                       agent.Config
	containerdAddress, containerdNamespace, podsDir, logLevel string
	registry                                                  registryFlags
	crypt                                                     agentCryptFlags
	sigs                                                      agentSignFlags
	csi                                                       agentCSIFlags
}

func runAgent(ctx context.Context, f agentDaemonFlags) error {
	cfg := f.cfg
	log, err := newLogger(f.logLevel)
	if err != nil {
		return err
	}
	if err := f.csi.check(); err != nil {
		return err
	}
	// Keys are read before anything else starts: a bad one fails here (the
	// key directory's, in agent.New).
	enc, err := f.crypt.encrypt.encryption()
	if err != nil {
		return err
	}
	if err := agent.CheckDecryptionKeyDir(f.crypt.keyDir); err != nil {
		return err
	}
	signer, err := f.sigs.apply(&cfg)
	if err != nil {
		return err
	}
	opts := []containerd.Option{containerd.WithLogger(log)}
	if f.podsDir != "" {
		opts = append(opts, containerd.WithPodsDir(f.podsDir))
	}
	res, err := containerd.New(ctx, f.containerdAddress, f.containerdNamespace, opts...)
	if err != nil {
		return err
	}
	defer res.Close()
	cfg.Resolver = res
	cfg.Logger = log
	cfg.Store = append(f.registry.options(), signer...)
	cfg.Encrypt, cfg.DecryptionKeyDir = enc, f.crypt.keyDir
	srv, err := agent.New(ctx, cfg)
	if err != nil {
		return err
	}
	return f.csi.serve(ctx, srv, log)
}

// newLogger is a daemon's logger: JSON on stderr, from --log-level.
func newLogger(level string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, errcode.New(errcode.Usage, "--log-level %q: use debug, info, warn or error", level)
	}
	return slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: l})), nil
}

func newAgentHealthCmd() *cobra.Command {
	var socket string
	var timeout time.Duration
	c := &cobra.Command{
		Use:   "health --socket PATH",
		Short: "Exit 0 if the agent answers on its socket (a liveness probe)",
		Args:  cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			client, err := agent.NewClient(socket)
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(c.Context(), timeout)
			defer cancel()
			if err := client.Health(ctx); err != nil {
				return coded(err)
			}
			fmt.Fprintln(c.OutOrStdout(), "ok")
			return nil
		},
	}
	c.Flags().StringVar(&socket, "socket", "/run/vmsnap/agent.sock", "the agent's socket")
	c.Flags().DurationVar(&timeout, "timeout", 5*time.Second, "how long to wait for an answer")
	return c
}
