package agent

import (
	"context"
	"errors"
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

// Prepare readies a memory-file image's RAM file in the cache of the
// request's namespace (the caller's, or for an admin any) and returns the
// QEMU arguments that map it. The image must be allowed by the agent's
// policy, as a restore's is. It takes one of the node's operation slots,
// and the operation timeout bounds it.
func (s *Server) Prepare(ctx context.Context, req api.PrepareRequest) (*api.PrepareResult, error) {
	c, err := requestCaller(ctx)
	if err != nil {
		return nil, err
	}
	if req.Image == "" {
		return nil, errcode.New(errcode.Usage, "a prepare needs %s (REF@sha256:...)", errcode.Field("image"))
	}
	if err := s.checkStream(req.Workers, 0); err != nil {
		return nil, err
	}
	ns := req.Namespace
	if ns == "" {
		ns = c.Namespace
	}
	if ns == "" {
		return nil, errcode.New(errcode.Usage, "%s calls from the node, in no namespace: name the namespace whose RAM cache to fill (%s)", c, errcode.Field("namespace"))
	}
	if !isDNSLabel(ns) {
		return nil, errcode.New(errcode.InvalidInput, "namespace %q is not a Kubernetes namespace name (a DNS label)", clipString(ns))
	}
	if err := c.mayActOn(ns); err != nil {
		return nil, errcode.New(errcode.Forbidden, "%s may fill only its own namespace's RAM cache (%s), not %s's: leave %s out", c, c.Namespace, ns, errcode.Field("namespace"))
	}
	if q := req.QEMUDir; q != "" {
		if len(q) > maxQEMUDir || !strings.HasPrefix(q, "/") || path.Clean(q) != q || strings.ContainsAny(q, "\x00\n") {
			return nil, errcode.New(errcode.InvalidInput, "%s %q: give the cache directory as the target QEMU sees it, an absolute clean path of at most %d bytes", errcode.Field("qemuDir"), clipString(q), maxQEMUDir)
		}
	}
	if err := s.checkImages(ctx, req.Image); err != nil {
		return nil, err
	}
	hold, err := s.holdOperation(ctx)
	if err != nil {
		return nil, err
	}
	defer hold.drop()
	store, err := s.readStore(ctx, ns, req.Image)
	if err != nil {
		return nil, err
	}
	timedOut := errcode.New(errcode.Busy, "the prepare did not finish within the agent's --operation-timeout of %s", s.cfg.OperationTimeout)
	ctx, cancel := context.WithTimeoutCause(ctx, s.cfg.OperationTimeout, timedOut)
	defer cancel()
	select {
	case s.slots <- struct{}{}:
		defer func() { <-s.slots }()
	case <-ctx.Done():
		return nil, errcode.New(errcode.Busy, "the node's %d operation slots stayed taken: try again later", s.cfg.MaxConcurrent)
	}
	res, err := snapshot.Prepare(ctx, snapshot.PrepareSpec{
		Image: req.Image, AllowTag: req.AllowTag, CacheDir: RAMCacheDir(s.cfg.StateDir, ns),
		MaxCacheBytes: s.cfg.RAMCacheMaxBytes, MaxCacheAge: s.cfg.RAMCacheMaxAge, MaxGuestMemory: s.cfg.MaxGuestMemory, QEMUDir: req.QEMUDir, Workers: req.Workers, Store: store,
	})
	if err != nil {
		if ctx.Err() != nil && context.Cause(ctx) != nil && errcode.Of(err) == errcode.Internal {
			return nil, context.Cause(ctx)
		}
		if errors.Is(context.Cause(ctx), timedOut) {
			// What it waited for keeps its code (a registry that did not
			// answer is REGISTRY_ERROR), as an operation's does (end).
			return nil, errcode.Wrap(errcode.Of(err), err, "%v", timedOut)
		}
		return nil, err
	}
	s.metrics.cache.prepared(ns, res)
	// The result names the file as QEMU sees it, not the node's path.
	if req.QEMUDir != "" {
		res.MemoryFile = path.Join(req.QEMUDir, path.Base(res.MemoryFile))
	}
	return res, nil
}

func clipString(s string) string {
	if len(s) > 80 {
		return s[:80] + "..."
	}
	return s
}
