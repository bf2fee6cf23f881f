package agent

import (
	"context"
	"path"
	"path/filepath"
	"strings"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
)

// RAMCacheDir is the agent's RAM file cache of one namespace: one
// directory per tenant, because QEMU before 8.2 opens a share=off file
// read-write (see ramfile.Cache), so a file is mapped only by VMs of the
// namespace that prepared it.
func RAMCacheDir(stateDir, namespace string) string {
	return filepath.Join(stateDir, "ram", namespace)
}

// restoreCacheDir is the cache a restore into a VM of namespace looks up
// prepared images in: its namespace's, or none for a VM in no namespace.
func restoreCacheDir(stateDir, namespace string) string {
	if namespace == "" || !isDNSLabel(namespace) {
		return ""
	}
	return RAMCacheDir(stateDir, namespace)
}

// maxQEMUDir bounds a request's qemuDir: it becomes part of a QEMU option.
const maxQEMUDir = 1024

// StartPrepare validates a prepare request and runs it in the background
// as an operation like a checkpoint's: it readies a memory-file image's
// RAM file in the cache of the request's namespace (the caller's, or for
// an admin any), and its result holds the QEMU arguments that map it. The
// image must be allowed by the agent's policy, as a restore's is. It
// counts as one of the caller's operations, takes one of the node's
// slots, and the operation timeout bounds it.
func (s *Server) StartPrepare(ctx context.Context, req api.PrepareRequest) (api.Operation, error) {
	ns, err := s.checkPrepare(ctx, req)
	if err != nil {
		return api.Operation{}, err
	}
	hold, err := s.holdOperation(ctx)
	if err != nil {
		return api.Operation{}, err
	}
	defer hold.drop()
	store, err := s.readStore(ctx, ns, req.Image)
	if err != nil {
		return api.Operation{}, err
	}
	o := newOp(api.KindPrepare, api.VMRef{}, nil, s.cfg.OperationTimeout)
	// Prepares act on no VM: each is its own, never BUSY for another.
	o.key = api.KindPrepare + "/" + o.id
	o.data.Namespace = ns
	// A prepare holds no VM's files: nothing of it for start to close.
	return s.start(hold, o, &Resolved{}, func(ctx context.Context) error {
		// Journaled, so that after a crash it is reported failed; its
		// half-filled file is the cache's to clean (ramfile.Cache).
		if err := s.journal.write(journalEntry{Op: o.snapshot()}); err != nil {
			return err
		}
		res, err := snapshot.Prepare(ctx, snapshot.PrepareSpec{
			Image: req.Image, AllowTag: req.AllowTag, CacheDir: RAMCacheDir(s.cfg.StateDir, ns), MaxCacheBytes: s.cfg.RAMCacheMaxBytes,
			MaxCacheAge: s.cfg.RAMCacheMaxAge, MaxGuestMemory: s.cfg.MaxGuestMemory, QEMUDir: req.QEMUDir, Workers: req.Workers, Store: store, Progress: s.progress(o),
		})
		if err != nil {
			return err
		}
		s.metrics.cache.prepared(ns, res)
		// The result names the file as QEMU sees it, not the node's path.
		if req.QEMUDir != "" {
			res.MemoryFile = path.Join(req.QEMUDir, path.Base(res.MemoryFile))
		}
		o.update(func(d *api.Operation) { d.Prepare = res })
		return nil
	})
}

// prepareAndWait runs a prepare as an operation of the caller in ctx and
// waits for its end, or ctx's: the in-process way to fill a cache (a CSI
// publication's), seen in the journal and the events like any other.
func (s *Server) prepareAndWait(ctx context.Context, req api.PrepareRequest) (*api.PrepareResult, error) {
	started, err := s.StartPrepare(ctx, req)
	if err != nil {
		return nil, err
	}
	o, err := s.ops.get(started.ID)
	if err != nil {
		return nil, err
	}
	select {
	case <-o.done:
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
	final := o.snapshot()
	if err := Result(final); err != nil {
		return nil, err
	}
	return final.Prepare, nil
}

// checkPrepare refuses, before anything is held or fetched, a prepare
// that is malformed or that its caller may not make, and returns the
// namespace whose cache it fills.
func (s *Server) checkPrepare(ctx context.Context, req api.PrepareRequest) (string, error) {
	c, err := requestCaller(ctx)
	if err != nil {
		return "", err
	}
	if req.Image == "" {
		return "", errcode.New(errcode.Usage, "a prepare needs %s (REF@sha256:...)", errcode.Field("image"))
	}
	if err := s.checkStream(req.Workers, 0); err != nil {
		return "", err
	}
	ns := req.Namespace
	if ns == "" {
		ns = c.Namespace
	}
	if ns == "" {
		return "", errcode.New(errcode.Usage, "%s calls from the node, in no namespace: name the namespace whose RAM cache to fill (%s)", c, errcode.Field("namespace"))
	}
	if !isDNSLabel(ns) {
		return "", errcode.New(errcode.InvalidInput, "namespace %q is not a Kubernetes namespace name (a DNS label)", clipString(ns))
	}
	if err := c.mayActOn(ns); err != nil {
		return "", errcode.New(errcode.Forbidden, "%s may fill only its own namespace's RAM cache (%s), not %s's: leave %s out", c, c.Namespace, ns, errcode.Field("namespace"))
	}
	if q := req.QEMUDir; q != "" {
		if len(q) > maxQEMUDir || !strings.HasPrefix(q, "/") || path.Clean(q) != q || strings.ContainsAny(q, "\x00\n") {
			return "", errcode.New(errcode.InvalidInput, "%s %q: give the cache directory as the target QEMU sees it, an absolute clean path of at most %d bytes", errcode.Field("qemuDir"), clipString(q), maxQEMUDir)
		}
	}
	return ns, s.checkImages(ctx, req.Image)
}

func clipString(s string) string {
	if len(s) > 80 {
		return s[:80] + "..."
	}
	return s
}
