package vmstate

import (
	"context"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// checkpointRun is one checkpoint, as every format's path shares it: the
// VM's monitor, the store, the options (the stream's progress among them),
// the VM's run state when the checkpoint began, the result it fills in,
// and, once the format has made its migration settings, the guard that
// keeps the checkpoint's promise to the VM. Checkpoint fills it in and
// hands it to the format it chose (checkpointStream, checkpointMappedRAM,
// checkpointMemoryFile), whose capture stopAndSave then drives.
type checkpointRun struct {
	mon   Monitor
	repo  ociimage.Repository
	opts  CheckpointOptions
	st    runState
	res   *CheckpointResult
	start time.Time
	g     *sourceGuard // set by guard
}

// capturePhases is a format's part of stopAndSave's sequence: save runs
// while the VM is stopped (live mode: running), store once it runs again.
type capturePhases interface {
	save(ctx context.Context) error
	store(ctx context.Context) error
}

// guard makes the source's migration settings (prepareMigration) under a
// guard, returned even with an error: defer its finish at once.
func (r *checkpointRun) guard(ctx context.Context, set migrationSettings) (*sourceGuard, error) {
	g := &sourceGuard{ctx: ctx, mon: r.mon, wasRunning: r.st.Running, phase: "preparing"}
	var err error
	g.settings, err = prepareMigration(ctx, r.mon, set)
	g.prepared = err == nil
	r.g = g
	return g, err
}

// stopAndSave is a checkpoint's one sequence, for every format, once the
// source is guarded and the format's capture is ready: stop the VM (live
// mode keeps it running), have QEMU save its state (p.save), run the
// WhileStopped hook, continue the VM in snapshot mode, finish storing the
// state (p.store: mapped-ram chunks its file once the VM runs again), and
// store the state manifest, the checkpoint's commit point.
func (r *checkpointRun) stopAndSave(ctx context.Context, p capturePhases) error {
	mon, g, opts, res := r.mon, r.g, r.opts, r.res
	res.Durations.Prepare = time.Since(r.start)
	stoppedAt := g.stoppedAt
	if opts.Mode != ModeLive && g.wasRunning && stoppedAt.IsZero() {
		g.phase = "stopping the VM"
		if err := mon.Execute(ctx, "stop", nil, nil); err != nil {
			return errcode.Ensure(errcode.QMPError, err, "stopping the VM")
		}
		stoppedAt = time.Now()
	}
	if err := p.save(ctx); err != nil {
		return err
	}

	var link Link
	if opts.WhileStopped != nil {
		g.phase = "capturing the disk"
		hookStart := time.Now()
		var err error
		if link, err = opts.WhileStopped(ctx); err != nil {
			return err
		}
		res.Durations.Stopped = time.Since(hookStart)
	}
	if opts.Mode == ModeSnapshot && g.wasRunning {
		if err := mon.Execute(ctx, "cont", nil, nil); err != nil {
			return errcode.Ensure(errcode.QMPError, err, "continuing the VM after the snapshot")
		}
		res.Downtime = time.Since(stoppedAt)
	}
	if err := p.store(ctx); err != nil {
		return err
	}

	g.phase = "storing the manifest and moving the tags"
	if err := pushStateManifest(ctx, r.repo, opts, res, link); err != nil {
		return err
	}
	if opts.Mode == ModePause && g.wasRunning {
		res.Downtime = time.Since(stoppedAt)
	}
	res.Durations.Total = time.Since(r.start)
	if st, serr := queryStatus(ctx, mon); serr == nil {
		res.VMRunning = st.Running
	}
	return nil
}
