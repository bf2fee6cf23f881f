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
	var (
		cfg         agent.Config
		ctrdAddress string
		ctrdNS      string
		podsDir     string
		logLevel    string
		reg         registryFlags
		crypt       agentCryptFlags
		sigs        agentSignFlags
	)
	c := &cobra.Command{
		Use:   "agent --socket PATH --state-dir DIR",
		Short: "Run the node agent: checkpoints and restores of this node's VMs over a local API",
		Long: `Run the node daemon (a Kubernetes DaemonSet on KVM nodes). It serves a JSON HTTP
API on a unix socket (mode 0660; give access to a group with --socket-group)
through which Jobs and controllers checkpoint and restore VMs on this node:

  POST   /v1/checkpoints        {"vm":{"podUID","container","qmp","disk"},"image","diskImage","mode","keep"}
  POST   /v1/restores           {"vm":{"podUID","container","qmp"},"image":"REF@sha256:...","paused"}
  POST   /v1/prepare            {"image":"REF@sha256:...","qemuDir","namespace"} -> {"qemuArgs","memoryFile",...}
  GET    /v1/operations[/ID]    DELETE /v1/operations/ID cancels
  GET    /v1/events[?operation=ID]   server-sent events of operation changes
  GET    /healthz  /readyz  /metrics (Prometheus)

VMs are named by pod UID and container name, with paths as seen inside that
container; the agent finds the container through the node's containerd and
maps the paths through its mounts. One operation per VM runs at a time (a
second gets BUSY), at most --max-concurrent per node. Each operation is
journaled in --state-dir: after a crash the agent continues any VM an
unfinished checkpoint had stopped. When a VM's container is deleted or
replaced, its operations are cancelled and forgotten.

Bounds on what a caller or a VM's QEMU can make the agent spend: a request's
"workers" may not exceed --max-workers and its "chunkSize" 16 MiB (larger
is refused with INVALID_INPUT); every operation ends after --operation-timeout
(counted from its acceptance, waiting for a slot included), failing and
putting its VM back as on any failure; a QMP message over 16 MiB ends the
connection with QMP_ERROR; a migration stream or mapped-ram staging file
larger than the VM's memory allows is aborted with QMP_ERROR, the VM
continued and the staging file freed.

Bounds on each caller (the callers of one namespace together, the node's
processes together): --max-connections-per-caller open connections,
counted from their accept (idle ones too; a request head at most 16 KiB),
--max-streams-per-caller event streams (one not read for 10s ends) and
--max-operations-per-caller operations pending or running, prepares
included. Beyond them, BUSY naming the flag.

Memory-file snapshots (a VM whose RAM is a shared memory-backend-file): a
checkpoint reads the RAM file QEMU names as its mem-path, opened as the disk
is: on a volume of the VM's own pod (below --kubelet-pods-dir/POD_UID; an
emptyDir with medium: Memory), without following links, mounts or "..", a
regular file, read-only; anything else is refused before the VM is stopped.
Encryption (docs/encryption-and-signing.md): --decryption-key-dir DIR holds each
namespace's private keys in DIR/NAMESPACE and the node's directly in DIR.
A restore, prepare or memory-file delta decrypts with the keys of the
namespace its VM or cache is in, and for an --admin-namespace caller also
with the node's; a checkpoint of a namespace's VM is encrypted for that
namespace's keys and every --encrypt-recipient.

POST /v1/prepare (vmsnap prepare --agent) materializes such a snapshot's RAM
file in the agent's cache of the caller's namespace, --state-dir/ram/NAMESPACE
(an admin may name another with "namespace"), under the same --allow-repository
and --layout-root checks as a restore, and answers with the QEMU arguments that
map it ("qemuDir": the cache directory as the target QEMU sees it). One cache
per namespace: QEMU before 8.2 opens a share=off file read-write, so a RAM file
is never shared across tenants. --ram-cache-max-bytes bounds each namespace's
cache. The request is synchronous and takes one of the --max-concurrent slots.

Registry credentials come from $DOCKER_CONFIG or --registry-config (a mounted
dockerconfigjson secret), never from flags.

Who may do what (docs/security-model.md): a caller is placed by its
peer credentials. A process in a pod's container acts only on VMs in that
pod's namespace and sees and cancels only their operations; a process in a
namespace named with --admin-namespace, or on the node outside any
container, acts on every VM (the agent needs hostPID to see callers'
processes). Whoever calls, every image a request names must be under one of
--allow-repository HOST[:PORT]/PREFIX (none given: no registry at all), and
every oci: layout under --layout-root (none given: no layout at all);
anything else is FORBIDDEN (exit status 12) before the VM is touched.

Per tenant: a PREFIX component {namespace} is the caller's pod namespace, so
--allow-repository reg:5000/vms/{namespace} lets a caller in tenant-a use
reg:5000/vms/tenant-a/... and nothing of tenant-b's; admins match it with
any namespace. A caller in a pod has only LAYOUT_ROOT/NAMESPACE of the
layout root (admins the whole root). Plain entries are shared by every
caller. Every directory from --layout-root down must be the agent's alone
(its owner, not writable by group or others).

Signatures (docs/encryption-and-signing.md): with --sign-key every checkpoint's
manifests are signed as cosign sign --key signs them. A restore or prepare
request's image must carry a cosign signature by one of the keys that apply
to it: every --verify-key, and the KEY of every --require-signature
HOST[:PORT]/PREFIX=KEY whose PREFIX covers its repository (the rules of
--allow-repository, {namespace} matching any namespace whoever asks); no
key applying, no signature needed.
It is checked before anything else of the image is read: an unsigned or
wrongly signed image is AUTH_FAILED.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			return coded(runAgent(c.Context(), cfg, ctrdAddress, ctrdNS, podsDir, logLevel, reg, crypt, sigs))
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
	c.Flags().Int64Var(&cfg.MaxGuestMemory, "max-guest-memory", 0,
		"refuse a prepare request whose image declares more guest memory than this many bytes, before fetching its layers (0: this node's memory)")

	c.Flags().StringVar(&ctrdAddress, "containerd-address", "/run/containerd/containerd.sock", "the node's containerd socket")
	c.Flags().StringVar(&ctrdNS, "containerd-namespace", "k8s.io", "containerd namespace of the kubelet's containers")
	c.Flags().StringVar(&podsDir, "kubelet-pods-dir", "/var/lib/kubelet/pods",
		"the kubelet's pods directory: a VM's QMP socket and disk are opened only on volumes below DIR/POD_UID (not on hostPath volumes); \"\": on any volume")
	c.Flags().StringVar(&logLevel, "log-level", "info", "debug, info, warn or error (JSON logs on stderr)")
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
	reg.add(c)
	crypt.encrypt.add(c)
	c.Flags().StringVar(&crypt.keyDir, "decryption-key-dir", "",
		"`DIR` of PEM private keys (a mounted Secret; each file mode 0600 or 0440): DIR/NAMESPACE/* are a namespace's, which its restores and prepares decrypt with "+
			"and its checkpoints are encrypted for; files directly in DIR are the node's, for --admin-namespace callers only; requests never carry keys")
	sigs.add(c)
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

func runAgent(ctx context.Context, cfg agent.Config, ctrdAddress, ctrdNS, podsDir, logLevel string, reg registryFlags, crypt agentCryptFlags, sigs agentSignFlags) error {
	var level slog.Level
	if err := level.UnmarshalText([]byte(logLevel)); err != nil {
		return errcode.New(errcode.Usage, "--log-level %q: use debug, info, warn or error", logLevel)
	}
	// Keys are read before anything else starts: a bad one fails here (the
	// key directory's, in agent.New).
	enc, err := crypt.encrypt.encryption()
	if err != nil {
		return err
	}
	if err := agent.CheckDecryptionKeyDir(crypt.keyDir); err != nil {
		return err
	}
	signer, err := sigs.apply(&cfg)
	if err != nil {
		return err
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	opts := []containerd.Option{containerd.WithLogger(log)}
	if podsDir != "" {
		opts = append(opts, containerd.WithPodsDir(podsDir))
	}
	res, err := containerd.New(ctx, ctrdAddress, ctrdNS, opts...)
	if err != nil {
		return err
	}
	defer res.Close()
	cfg.Resolver = res
	cfg.Logger = log
	cfg.Store = append(reg.options(), signer...)
	cfg.Encrypt, cfg.DecryptionKeyDir = enc, crypt.keyDir
	srv, err := agent.New(ctx, cfg)
	if err != nil {
		return err
	}
	return srv.Serve(ctx)
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
