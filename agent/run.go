package agent

import (
	"context"
	"errors"
	"os"
	"path"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/internal/testing/hook"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/rootfs"
)

// StartCheckpoint validates and resolves a checkpoint request, registers the
// operation (BUSY if the VM has one) and runs it in the background.
func (s *Server) StartCheckpoint(ctx context.Context, req api.CheckpointRequest) (api.Operation, error) {
	if err := s.checkStream(req.Workers, req.ChunkSize); err != nil {
		return api.Operation{}, err
	}
	spec := snapshot.CheckpointSpec{
		QMPPath: req.VM.QMPPath, DiskPath: req.VM.DiskPath, Image: req.Image, DiskImage: req.DiskImage, RootfsImage: req.RootfsImage, Mode: req.Mode,
		Stream: chunk.StreamOptions{ChunkSize: req.ChunkSize, Workers: req.Workers},
		// QEMU 9+ in snapshot mode writes a mapped-ram file there (QEMU
		// gets it as a descriptor, so its container need not see the path).
		StagingDir: s.cfg.StateDir,
		Parent:     req.Parent, MaxChain: req.MaxChain,
	}
	// Retention after the checkpoint: the request's, else the agent's
	// default. It runs below, once the success is journaled.
	keep := req.Keep
	if keep == 0 {
		keep = s.cfg.Keep
	}
	if keep < 0 {
		return api.Operation{}, errcode.New(errcode.InvalidInput, "keep %d: give the number of checkpoints to keep, or 0 for the agent's default", keep)
	}
	if err := spec.Validate(); err != nil {
		return api.Operation{}, err
	}
	hold, vm, err := s.admit(ctx, req.VM, req.Image, req.DiskImage, req.RootfsImage)
	if err != nil {
		return api.Operation{}, err
	}
	defer hold.drop()
	if spec.Store, err = s.storeFor(ctx, vm.Namespace); err != nil {
		vm.Close()
		return api.Operation{}, err
	}
	// From here the operation uses the files the resolver opened, never the
	// paths; the container's paths name them in messages and annotations.
	spec.Handles = &vm.Handles
	spec.StagingOwner = stagingOwner(vm.Target)
	spec.Records = s.parentRecords(vm.Target)
	if spec.Handles.OpenRAMFile == nil {
		// Never the host path QEMU names: only a resolver that opens it
		// within the VM's container may give a RAM file.
		spec.Handles.OpenRAMFile = func(memPath string) (*os.File, error) {
			return nil, errcode.New(errcode.Forbidden, "the VM's RAM is the file %s, which this agent's resolver cannot open within the VM's container: checkpoint it with format stream", memPath)
		}
	}
	if spec.DiskPath != "" {
		spec.DiskPath = path.Clean(spec.DiskPath)
	}
	if vm.DiskInRootfs {
		spec.DiskInRootfs, spec.DiskRootfsPath = true, spec.DiskPath
	}
	if err := spec.CheckDiskPlace(); err != nil {
		vm.Close()
		return api.Operation{}, err
	}
	target := vm.Target
	if spec.RootfsImage != "" {
		rc, ok := s.cfg.Resolver.(RootfsCapturer)
		if !ok {
			vm.Close()
			return api.Operation{}, errcode.New(errcode.Usage, "this agent's resolver cannot capture a container's writable layer (it needs containerd)")
		}
		spec.CaptureRootfs = func(ctx context.Context, repo ociimage.Repository, progress func(int64)) (*rootfs.LayerResult, error) {
			return rc.CaptureRootfs(ctx, target, repo, progress)
		}
	}
	o := newOp(api.KindCheckpoint, req.VM, &target, s.cfg.OperationTimeout)
	return s.start(hold, o, vm, func(ctx context.Context) error {
		hook.AfterResolve()
		spec.Progress = s.progress(o)
		spec.BeforeStop = func(ctx context.Context, running bool) error {
			return s.journal.write(journalEntry{Op: o.snapshot(), VMWasRunning: running})
		}
		res, err := snapshot.Checkpoint(ctx, spec)
		if err != nil {
			return err
		}
		// Journal the success before anything else: a pause-mode VM is
		// stopped on purpose now, and recovery must leave it so.
		snap := o.update(func(d *api.Operation) { d.Checkpoint = res })
		if err := s.journal.write(journalEntry{Op: snap}); err != nil || keep == 0 {
			return err
		}
		// After the journal: an agent that dies while pruning must not
		// have its recovery continue a VM that pause mode left stopped.
		pruned := snapshot.PruneAfterCheckpoint(ctx, spec.Image, keep, spec.Store)
		o.update(func(d *api.Operation) { d.Checkpoint.Pruned = pruned })
		return nil
	})
}

// StartRestore validates and resolves a restore request and runs it in the
// background. Its result carries the VM's new endpoint.
func (s *Server) StartRestore(ctx context.Context, req api.RestoreRequest) (api.Operation, error) {
	if req.Image == "" || req.VM.QMPPath == "" {
		return api.Operation{}, errcode.New(errcode.Usage, "a restore needs vm.qmp and image")
	}
	if err := s.checkStream(req.Workers, 0); err != nil {
		return api.Operation{}, err
	}
	if req.VM.DiskPath != "" {
		return api.Operation{}, errcode.New(errcode.Usage, "the agent restores VM state only: put the disk overlay in place before QEMU starts (the restore init container does)")
	}
	hold, vm, err := s.admit(ctx, req.VM, req.Image)
	if err != nil {
		return api.Operation{}, err
	}
	defer hold.drop()
	store, err := s.readStore(ctx, vm.Namespace, req.Image)
	if err != nil {
		vm.Close()
		return api.Operation{}, err
	}
	target := vm.Target
	o := newOp(api.KindRestore, req.VM, &target, s.cfg.OperationTimeout)
	return s.start(hold, o, vm, func(ctx context.Context) error {
		// Journal it too: after a crash the operation is reported failed
		// (a half-fed QEMU discards the partial state by itself).
		if err := s.journal.write(journalEntry{Op: o.snapshot()}); err != nil {
			return err
		}
		res, err := snapshot.RestoreState(ctx, snapshot.RestoreSpec{
			QMPPath: req.VM.QMPPath, Handles: &vm.Handles, Image: req.Image, AllowTag: req.AllowTag, Paused: req.Paused,
			Stream: chunk.StreamOptions{Workers: req.Workers}, Store: store, Progress: s.progress(o),
			// A mapped-ram image is staged as a file: the agent's root is
			// read-only, its state directory is not.
			StagingDir: s.cfg.StateDir, StagingOwner: stagingOwner(target),
			// The RAM cache of the VM's own namespace, and no other: what
			// its callers prepared there (StartPrepare).
			CacheDir: restoreCacheDir(s.cfg.StateDir, target.Namespace),
		})
		if err == nil {
			res.Endpoint = &api.Endpoint{PodUID: req.VM.PodUID, Container: req.VM.Container, QMPPath: req.VM.QMPPath}
			o.update(func(d *api.Operation) { d.Restore = res })
		}
		return err
	})
}

// checkStream refuses a request's stream settings beyond the agent's
// bounds: they decide how much of the agent's memory the operation holds.
// Refused rather than clamped, so that the caller learns the bound.
func (s *Server) checkStream(workers, chunkSize int) error {
	if workers < 0 || workers > s.cfg.MaxWorkers {
		return errcode.New(errcode.InvalidInput, "workers %d: this agent allows 1..%d (its --max-workers); leave it out for the default", workers, s.cfg.MaxWorkers)
	}
	if chunkSize < 0 || chunkSize > chunk.MaxChunkSize {
		return errcode.New(errcode.InvalidInput, "chunkSize %d: at most %d (%d MiB); leave it out for the default", chunkSize, chunk.MaxChunkSize, chunk.MaxChunkSize>>20)
	}
	return nil
}

// checkImages refuses, before the VM is touched, a request that names an
// image the agent's policy does not allow (policy.go): the image, then the
// disk image, then the rootfs image. What is allowed depends on the
// request's caller (its namespace's repositories and layouts).
func (s *Server) checkImages(ctx context.Context, image string, more ...string) error {
	c, err := requestCaller(ctx)
	if err != nil {
		return err
	}
	names := []string{"image", "disk image", "rootfs image"}
	for i, ref := range append([]string{image}, more...) {
		if err := s.policy.check(c, names[i], ref); err != nil {
			return err
		}
	}
	return nil
}

// admit readies a request on a VM for its operation, in this order, so
// that a refused caller costs the agent least: the images it names must
// be allowed (checkImages), the caller must have an operation to spare
// (holdOperation), and the VM must be one it may act on (resolve). The
// caller owns vm's files and drops the hold (which an operation it
// started keeps).
func (s *Server) admit(ctx context.Context, ref api.VMRef, image string, more ...string) (*opHold, *Resolved, error) {
	if err := s.checkImages(ctx, image, more...); err != nil {
		return nil, nil, err
	}
	hold, err := s.holdOperation(ctx)
	if err != nil {
		return nil, nil, err
	}
	vm, err := s.resolve(ctx, ref)
	if err != nil {
		hold.drop()
		return nil, nil, err
	}
	return hold, vm, nil
}

// resolve finds the VM and opens its files; the caller owns them. It is
// FORBIDDEN unless the VM is in the request's caller's namespace or the
// caller is an admin (caller.go).
func (s *Server) resolve(ctx context.Context, vm api.VMRef) (*Resolved, error) {
	caller, err := requestCaller(ctx)
	if err != nil {
		return nil, err
	}
	if vm.PodUID == "" {
		return nil, errcode.New(errcode.VMNotFound, "no pod UID given: name the VM's pod by its UID (the Job's SOURCE_POD_UID)")
	}
	if vm.Container == "" {
		return nil, errcode.New(errcode.Usage, "no container given: name the QEMU container of the pod")
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	r, err := s.cfg.Resolver.Resolve(ctx, vm)
	if err != nil {
		return nil, err
	}
	if err := caller.mayActOn(r.Namespace); err != nil {
		r.Close()
		return nil, err
	}
	return r, nil
}

// start registers o and runs work in the background once a slot is free.
// The operation owns vm's files: they are closed when it ends, however.
// It keeps hold, one of its caller's operations, until it ends.
func (s *Server) start(hold *opHold, o *op, vm *Resolved, work func(context.Context) error) (api.Operation, error) {
	if err := s.ops.add(o); err != nil {
		vm.Close()
		return api.Operation{}, err
	}
	hold.keep(o)
	snap := o.snapshot()
	s.metrics.inFlight.WithLabelValues(snap.Kind, api.StatePending).Inc()
	s.events.publish(snap)
	go func() {
		defer vm.Close()
		defer func() {
			// runWork recovers the work; this is the bookkeeping's last resort.
			if v := recover(); v != nil {
				_ = Recovered(s.log, v, "an operation's bookkeeping", "op", o.id)
			}
		}()
		s.run(o, work)
	}()
	return snap, nil
}

func (s *Server) run(o *op, work func(context.Context) error) {
	kind := o.snapshot().Kind
	log := s.log.With("op", o.id, "kind", kind, "vm", o.key)
	defer s.ops.finish(o)
	defer o.cancel(nil)

	pending := true
	defer func() {
		if pending {
			s.metrics.inFlight.WithLabelValues(kind, api.StatePending).Dec()
		}
	}()
	select {
	case s.slots <- struct{}{}:
	case <-o.ctx.Done():
		err := context.Cause(o.ctx)
		if o.timedOut() {
			err = errcode.New(errcode.Busy, "the node's %d operation slots stayed taken", s.cfg.MaxConcurrent)
		}
		s.end(o, err, 0, log)
		return
	}
	defer func() { <-s.slots }()
	s.metrics.inFlight.WithLabelValues(kind, api.StatePending).Dec()
	pending = false
	s.metrics.inFlight.WithLabelValues(kind, api.StateRunning).Inc()
	defer s.metrics.inFlight.WithLabelValues(kind, api.StateRunning).Dec()

	s.events.publish(o.update(func(d *api.Operation) { d.State = api.StateRunning }))
	log.Info("operation started")
	start := time.Now()
	err := s.runWork(o, log, work)
	if err == nil && o.ctx.Err() != nil {
		// Finished just as it was cancelled: the result stands.
		err = nil
	}
	s.end(o, err, time.Since(start).Seconds(), log)
}

// end records an operation's outcome, in the journal first.
func (s *Server) end(o *op, err error, seconds float64, log interface {
	Info(string, ...any)
	Error(string, ...any)
}) {
	// The work is over: free the VM and the caller's count first, so that
	// whoever sees the end (an event, or a poll of the operation) can
	// start the next one at once.
	s.ops.release(o)
	s.held.give(o.holder, operations)
	state := api.StateSucceeded
	switch {
	case err == nil:
	case o.timedOut():
		// What it was waiting for keeps its code (a QEMU that did not
		// answer is QMP_ERROR, a slow registry REGISTRY_ERROR).
		state = api.StateFailed
		err = errcode.Wrap(errcode.Of(err), err, "%v", context.Cause(o.ctx))
	case o.ctx.Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.Cause(o.ctx)) || errcode.Of(err) == errcode.Internal):
		// Cancelled by a caller or because the VM went away: report why.
		// A caller's cancellation says less than what the operation was
		// waiting for (a registry that did not answer): that keeps its code.
		state = api.StateCancelled
		if cause := context.Cause(o.ctx); errcode.Of(cause) == errcode.Internal && errcode.Of(err) != errcode.Internal {
			err = errcode.Wrap(errcode.Of(err), err, "%v", cause)
		} else {
			err = cause
		}
	default:
		state = api.StateFailed
	}
	final := o.update(func(d *api.Operation) {
		d.State = state
		d.Progress = nil
		if err != nil {
			e := toAPIError(err)
			d.Error = &e
		}
	})
	if jerr := s.journal.remove(o.id); jerr != nil {
		log.Error("removing the journal entry", "err", jerr)
	}
	s.metrics.finished(final.Kind, state, seconds)
	if state == api.StateSucceeded {
		s.metrics.moved(final, seconds)
		log.Info("operation succeeded", "seconds", seconds)
	} else {
		log.Info("operation ended", "state", state, "code", final.Error.Code, "err", final.Error.Message)
	}
	s.events.publish(final)
}

// progress publishes progress at most twice a second per operation.
func (s *Server) progress(o *op) snapshot.Progress {
	return func(phase string, n int64) {
		o.mu.Lock()
		if time.Since(o.lastProgress) < 500*time.Millisecond {
			o.mu.Unlock()
			return
		}
		o.lastProgress = time.Now()
		o.mu.Unlock()
		s.events.publish(o.update(func(d *api.Operation) { d.Progress = &api.OperationProgress{Phase: phase, Bytes: n} }))
	}
}

func toAPIError(err error) api.Error { return api.ErrorOf(err) }
