// Package agent runs checkpoints and restores of QEMU VMs on a node: the
// daemon and the client a Job uses to reach it.
//
// The operations themselves are package internal/snapshot, which the CLI also
// calls in its own process; the daemon calls them with a VM's files opened
// by its resolver beneath the pod's volumes (snapshot.Handles). The daemon
// (Server) adds what a node needs:
//
//   - a JSON HTTP API on a unix socket (mode 0660, a configurable group);
//   - finding a VM by pod UID and container name through a Resolver
//     (containerd on a real node), never by pod name;
//   - one operation per VM at a time (BUSY for a second) and a bounded
//     number per node;
//   - a journal under the state directory, so that after a crash the
//     daemon continues any VM an unfinished checkpoint had stopped;
//   - dropping every record of a VM whose container is deleted or replaced,
//     cancelling its operations, so callers get VM_NOT_FOUND at once;
//   - an event stream (server-sent events), health, readiness and
//     Prometheus metrics.
//
// It also decides who may ask for what (caller.go: a caller placed by its
// peer pid through containerd; policy.go: --allow-repository and
// --layout-root), bounds what each caller may hold (limits.go), and holds
// the decryption keys per namespace (keys.go). docs/security-model.md says
// what this means for an operator.
//
// It is not a controller: it acts only on requests, for VMs on its node. It
// does not hold the operations (internal/snapshot), the JSON documents
// (agent/api), the Kubernetes YAML (internal/manifests) or the finding of
// VMs in containerd (agent/containerd, behind the Resolver interface). It
// must never open a path a request, a pod or a QEMU names other than
// through its resolver, beneath the pod's own volumes.
package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
	"github.com/vmsnap/vmsnap/vmstate"
)

// Config configures a Server.
type Config struct {
	Socket      string // unix socket path of the API
	SocketGroup string // group (name or GID) that may use the socket; empty: the agent's own
	StateDir    string // journal and staging; must survive a restart of the agent
	// MaxConcurrent bounds the operations running at once on this node
	// (default 2); more wait as pending.
	MaxConcurrent int
	Resolver      Resolver
	// Store is how the agent reaches registries (credentials, CA, ...),
	// never keys: those are DecryptionKeyDir and Encrypt, which the agent
	// applies per caller and namespace (keys.go).
	Store  []ociimage.Option
	Logger *slog.Logger

	// DecryptionKeyDir holds the private keys operations decrypt with: the
	// node's directly in it (admin callers only), each namespace's in
	// DIR/NAMESPACE (keydir.go); "": none.
	DecryptionKeyDir string
	// Encrypt, if set, is what every checkpoint is encrypted for besides its
	// namespace's keys (the node's recipients, and a dedup secret).
	Encrypt *imgcrypt.EncryptOptions

	// Authorization (caller.go, policy.go).
	// AdminNamespaces are pod namespaces whose callers may act on any VM
	// and see every operation (a platform controller's).
	AdminNamespaces []string
	// AllowRepositories are the HOST[:PORT]/PREFIX a request's registry
	// references must be under; none: every registry reference is refused.
	AllowRepositories []string
	// LayoutRoot is the directory a request's oci: layouts must be under;
	// "": every layout is refused.
	LayoutRoot string
	// VerifyKeys: every image a restore or prepare reads must be signed by
	// one of them (signatures.go). RequireSignatures,
	// HOST[:PORT]/PREFIX=KEYFILE, add a key for the repositories under
	// PREFIX.
	VerifyKeys        []ociimage.VerifyKey
	RequireSignatures []string

	// Bounds on one operation.

	// MaxWorkers bounds a request's workers (default DefaultMaxWorkers(),
	// at most HardMaxWorkers): each one holds chunk buffers (see
	// chunk.StreamOptions.EncodeMemory), so a caller must not pick how
	// much of the agent's memory one operation takes. A request above it
	// is refused (INVALID_INPUT), not clamped, so the caller knows.
	MaxWorkers int
	// Limits bound what one caller may hold at once: connections, event
	// streams, operations (limits.go).
	Limits Limits
	// OperationTimeout bounds every operation from its acceptance, its
	// wait for a slot included (default 30m): a QEMU that stops answering,
	// or a caller killed mid-wait, never holds a slot for good. When it
	// fires, the operation fails and its VM is put back as on any failure.
	OperationTimeout time.Duration

	// RAMCacheMaxBytes bounds each namespace's RAM file cache
	// (STATE_DIR/ram/NAMESPACE, filled by prepare requests): once a file
	// is ready, the least recently used others past it are removed (0: no
	// bound).
	RAMCacheMaxBytes int64
	// RAMCacheMaxAge, applied with RAMCacheMaxBytes, removes the files of
	// a namespace's cache unused for longer (0: no bound). Published files
	// (a pod's CSI volume shows them) stay either way.
	RAMCacheMaxAge time.Duration

	// Keep is the retention a checkpoint request without "keep" gets: the
	// newest checkpoints its state repository keeps (0: no prune).
	Keep int

	// MaxGuestMemory refuses a prepare of an image that declares more
	// guest memory, before a layer of it is fetched (default
	// vmstate.DefaultMaxGuestMemory, the node's memory).
	MaxGuestMemory int64
}

// HardMaxWorkers is the most workers one request may ever ask for: with the
// largest chunks, a worker holds up to about 50 MiB (EncodeMemory), and an
// agent's memory is bounded by its DaemonSet.
const HardMaxWorkers = 16

// DefaultMaxWorkers is MaxWorkers' default: twice the CPUs the agent may
// use, at most HardMaxWorkers. More workers than CPUs only help while a
// registry is slower than compression.
func DefaultMaxWorkers() int { return min(2*runtime.GOMAXPROCS(0), HardMaxWorkers) }

// DefaultOperationTimeout is OperationTimeout's default.
const DefaultOperationTimeout = 30 * time.Minute

// Server is the node daemon.
type Server struct {
	cfg     Config
	log     *slog.Logger
	ops     *table
	events  *broker
	metrics *metrics
	journal *journal
	slots   chan struct{}
	policy  *imagePolicy
	keys    *keyDir // nil: no --decryption-key-dir
	held    *holdings
	placed  placedCache // callers placed, by process (caller_linux.go)
	// signatures are the signatures restores require (signatures.go).
	signatures *signaturePolicy

	ready   chan struct{} // closed once the resolver's watch runs
	readyMu sync.Once
}

// New prepares a server: it opens the journal and recovers what a previous
// run left unfinished (continuing VMs it had stopped) before it accepts any
// request.
func New(ctx context.Context, cfg Config) (*Server, error) {
	if cfg.Resolver == nil {
		return nil, errcode.New(errcode.Usage, "the agent needs a resolver to find VMs")
	}
	if cfg.StateDir == "" {
		return nil, errcode.New(errcode.Usage, "the agent needs --state-dir")
	}
	if cfg.MaxConcurrent <= 0 {
		cfg.MaxConcurrent = 2
	}
	if cfg.MaxWorkers <= 0 {
		cfg.MaxWorkers = DefaultMaxWorkers()
	}
	if cfg.MaxWorkers > HardMaxWorkers {
		return nil, errcode.New(errcode.Usage, "--max-workers %d: at most %d (each worker holds up to about 50 MiB)", cfg.MaxWorkers, HardMaxWorkers)
	}
	if cfg.OperationTimeout <= 0 {
		cfg.OperationTimeout = DefaultOperationTimeout
	}
	if l := cfg.Limits; l.Connections < 0 || l.Streams < 0 || l.Operations < 0 {
		return nil, errcode.New(errcode.Usage, "the per-caller limits (--max-connections-per-caller, --max-streams-per-caller, --max-operations-per-caller) must be at least 1")
	}
	if cfg.MaxGuestMemory < 0 {
		return nil, errcode.New(errcode.Usage, "--max-guest-memory %d: give a size in bytes, or 0 for this node's memory", cfg.MaxGuestMemory)
	}
	if cfg.MaxGuestMemory == 0 {
		cfg.MaxGuestMemory = vmstate.DefaultMaxGuestMemory()
	}
	if cfg.RAMCacheMaxBytes < 0 {
		return nil, errcode.New(errcode.Usage, "--ram-cache-max-bytes %d: give a size in bytes, or 0 for no bound", cfg.RAMCacheMaxBytes)
	}
	if cfg.RAMCacheMaxAge < 0 {
		return nil, errcode.New(errcode.Usage, "--ram-cache-max-age %s: give a duration, or 0 for no bound", cfg.RAMCacheMaxAge)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewJSONHandler(os.Stderr, nil))
	}
	j, err := openJournal(cfg.StateDir)
	if err != nil {
		return nil, err
	}
	policy, err := newImagePolicy(cfg.AllowRepositories, cfg.LayoutRoot, cfg.StateDir)
	if err != nil {
		return nil, err
	}
	keys, err := openKeyDir(cfg.DecryptionKeyDir)
	if err != nil {
		return nil, err
	}
	signatures, err := newSignaturePolicy(cfg.VerifyKeys, cfg.RequireSignatures)
	if err != nil {
		return nil, err
	}
	s := &Server{
		cfg:     cfg,
		log:     cfg.Logger,
		ops:     newTable(),
		events:  newBroker(),
		metrics: newMetrics(),
		journal: j,
		slots:   make(chan struct{}, cfg.MaxConcurrent),
		policy:  policy,
		keys:    keys,
		held:    newHoldings(cfg.Limits),
		ready:   make(chan struct{}),

		signatures: signatures,
	}
	s.metrics.reg.MustRegister(newHeldBytes(cfg.StateDir))
	s.recover(ctx)
	return s, nil
}

// Registry is the Prometheus registry of the server's metrics.
func (s *Server) Registry() *prometheus.Registry { return s.metrics.reg }

// Serve listens on the configured socket and serves until ctx ends, then
// cancels running operations (each puts its VM back as on any failure) and
// returns.
func (s *Server) Serve(ctx context.Context) error {
	ln, err := listen(s.cfg.Socket, s.cfg.SocketGroup)
	if err != nil {
		return err
	}
	return s.ServeListener(ctx, ln)
}

// ServeListener serves on ln until ctx ends. Only callers whose peer
// credentials the agent accepts are served (see peercred.go).
func (s *Server) ServeListener(ctx context.Context, ln net.Listener) error {
	refusals := newRefusals(s.log)
	checked, err := withPeerCheck(ln, s.cfg.SocketGroup, s.log, refusals)
	if err != nil {
		ln.Close()
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ln = s.admitting(ctx, checked, refusals)
	go s.watch(ctx)
	srv := &http.Server{
		Handler: s.Handler(),
		// net/http's own complaints go into the agent's JSON log.
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
		ReadHeaderTimeout: 10 * time.Second,
		MaxHeaderBytes:    maxHeaderBytes,
		// A connection between requests is closed after a while: a caller
		// must not hold the agent's descriptors by opening connections and
		// leaving them (an event stream is a request, and stays).
		IdleTimeout: 2 * time.Minute,
		BaseContext: func(net.Listener) context.Context { return ctx },
		ConnContext: connContext, // requests find their caller (caller.go)
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	s.log.Info("agent listening", "socket", ln.Addr().String(), "stateDir", s.cfg.StateDir, "maxConcurrent", s.cfg.MaxConcurrent,
		"maxWorkers", s.cfg.MaxWorkers, "operationTimeout", s.cfg.OperationTimeout.String(),
		"adminNamespaces", s.cfg.AdminNamespaces, "allowRepositories", s.cfg.AllowRepositories, "layoutRoot", s.cfg.LayoutRoot)
	select {
	case err := <-errc:
		return errcode.Wrap(errcode.Internal, err, "serving the agent API")
	case <-ctx.Done():
	}
	shutdown, done := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer done()
	s.events.close() // event streams end, so Shutdown does not wait for them
	_ = srv.Shutdown(shutdown)
	s.ops.cancelAll(errcode.New(errcode.Internal, "the agent is shutting down"))
	s.ops.wait(shutdown)
	return nil
}

// watch drops everything about VMs whose containers go away.
func (s *Server) watch(ctx context.Context) {
	for ctx.Err() == nil {
		if err := s.watchOnce(ctx); err != nil {
			s.log.Error("watching containers failed; retrying", "err", err)
			select {
			case <-time.After(2 * time.Second):
			case <-ctx.Done():
			}
		}
	}
}

// watchOnce follows one of the resolver's watches to its end. A panic ends
// only this watch (INTERNAL): watch starts another.
func (s *Server) watchOnce(ctx context.Context) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = Recovered(s.log, v, "the container watch")
		}
	}()
	gone, err := s.cfg.Resolver.Watch(ctx)
	if err != nil {
		return err
	}
	s.readyMu.Do(func() { close(s.ready) })
	for g := range gone {
		s.forget(g)
	}
	return nil
}

// forget cancels the operations of a VM whose container is gone and removes
// every record of them: later requests about the VM get VM_NOT_FOUND.
func (s *Server) forget(g Gone) {
	why := errcode.New(errcode.VMNotFound, "the container %s of pod %s was deleted or replaced", g.Container, g.PodUID)
	// The record first: once a VM's operations are gone, so is it.
	if err := s.forgetParent(g); err != nil {
		s.log.Error("removing the record of a VM that is gone", "pod", g.PodUID, "container", g.Container, "err", err)
	}
	for _, op := range s.ops.forVM(g) {
		log := s.log.With("op", op.id, "pod", g.PodUID, "container", g.Container, "containerID", g.ContainerID)
		if op.ended() {
			log.Debug("VM gone: forgetting its finished operation")
		} else {
			log.Info("VM gone: cancelling its operation")
			op.cancel(why)
		}
		s.ops.remove(op, why)
	}
}

func listen(path, group string) (net.Listener, error) {
	if path == "" {
		return nil, errcode.New(errcode.Usage, "the agent needs --socket PATH")
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "creating the socket's directory")
	}
	// A socket left by a previous run is ours to replace; anything else is not.
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, errcode.New(errcode.Usage, "%s exists and is not a socket: choose another --socket", path)
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil, errcode.New(errcode.Busy, "another agent already listens at %s", path)
		}
		_ = os.Remove(path)
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "listening at %s", path)
	}
	gid := -1
	if group != "" {
		if gid, err = lookupGroup(group); err != nil {
			ln.Close()
			return nil, err
		}
	}
	if err := os.Chown(path, -1, gid); err != nil && gid >= 0 {
		ln.Close()
		return nil, errcode.Wrap(errcode.Internal, err, "giving the socket to group %s", group)
	}
	// Owner and group only: the socket starts checkpoints of any VM here.
	if err := os.Chmod(path, 0o660); err != nil {
		ln.Close()
		return nil, errcode.Wrap(errcode.Internal, err, "setting the socket's mode")
	}
	return ln, nil
}

func lookupGroup(group string) (int, error) {
	if gid, err := strconv.Atoi(group); err == nil {
		return gid, nil
	}
	g, err := user.LookupGroup(group)
	if err != nil {
		return -1, errcode.Wrap(errcode.Usage, err, "socket group %q", group)
	}
	gid, _ := strconv.Atoi(g.Gid)
	return gid, nil
}

// continueJournaled continues the VM of an unfinished checkpoint, found
// again through the resolver as the request named it (pod UID, container,
// QMP path inside the container), never through a host path from the
// journal: the journal is a file, and the pod may have changed since. The
// VM is continued only if it still runs in the container the checkpoint
// stopped; a container replaced since runs another QEMU, which is left
// alone. The agent acts for itself here, for no caller: it asks its
// resolver directly.
func (s *Server) continueJournaled(ctx context.Context, op api.Operation) error {
	ref := api.VMRef{PodUID: op.VM.PodUID, Container: op.VM.Container, QMPPath: op.VM.QMPPath}
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	vm, err := s.cfg.Resolver.Resolve(rctx, ref)
	if err != nil {
		return err
	}
	defer vm.Close()
	if vm.ContainerID != op.Target.ContainerID {
		return errcode.New(errcode.VMNotFound, "the container %s of pod %s is not the one the checkpoint stopped (%s, now %s): left alone",
			op.VM.Container, op.VM.PodUID, op.Target.ContainerID, vm.ContainerID)
	}
	return continueVM(ctx, vm.QMP, op.VM.QMPPath)
}

// putBack continues the VM of an unfinished checkpoint whose journal entry
// says it stopped the VM, and says what became of the VM ("; the VM was
// continued"), or "" if there was nothing to do.
func (s *Server) putBack(ctx context.Context, e journalEntry, log *slog.Logger) string {
	if e.Op.Kind != api.KindCheckpoint || !e.VMWasRunning || e.Op.Checkpoint != nil || e.Op.Target == nil {
		return ""
	}
	if err := s.continueJournaled(ctx, e.Op); err != nil {
		log.Error("could not continue the VM an unfinished checkpoint had stopped", "err", err)
		return fmt.Sprintf("; continuing the VM failed: %v", err)
	}
	log.Info("continued the VM an unfinished checkpoint had stopped")
	return "; the VM was continued"
}

// recover finishes what a previous run of the agent left in its journal.
func (s *Server) recover(ctx context.Context) {
	entries, err := s.journal.list()
	if err != nil {
		s.log.Error("reading the journal", "err", err)
		return
	}
	for _, e := range entries {
		log := s.log.With("op", e.Op.ID, "kind", e.Op.Kind, "pod", e.Op.VM.PodUID)
		outcome := "the agent stopped during this operation" + s.putBack(ctx, e, log)
		op := e.Op
		op.Updated = time.Now().UTC()
		op.Progress = nil
		if op.Checkpoint != nil {
			// It had succeeded; only the last bookkeeping was lost.
			op.State = api.StateSucceeded
		} else {
			op.State = api.StateFailed
			apiErr := toAPIError(errcode.New(errcode.Internal, "%s", outcome))
			op.Error = &apiErr
		}
		s.ops.addFinished(&op)
		s.metrics.finished(op.Kind, op.State, 0)
		if err := s.journal.remove(e.Op.ID); err != nil {
			log.Error("removing the journal entry", "err", err)
		}
	}
}
