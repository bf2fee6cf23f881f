package vmstate

import (
	"context"
	"fmt"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// cleanupTimeout bounds what we do to put a VM back after a failure, even
// when the caller's context has already been cancelled.
const cleanupTimeout = 30 * time.Second

// sourceGuard keeps a checkpoint's promise to the source VM, on every
// format's path (checkpointRun.guard makes it): a VM is never left stopped
// by a failed checkpoint. Whatever happens, the migration settings are put
// back; on failure, a migration that may still run is cancelled, a VM that
// was running runs again, and the error says so. Its one deferred call,
// finish, does all of it.
type sourceGuard struct {
	ctx        context.Context
	mon        Monitor
	wasRunning bool
	settings   func(context.Context) // puts the migration settings back
	prepared   bool                  // the settings were made: the checkpoint began
	// migrating is set before a migration is asked for (if the reply is
	// lost, it may still run), and cleared once it is over.
	migrating bool
	phase     string // what the checkpoint is doing, for an interruption
	// stoppedAt, if set, is when QEMU itself stopped the VM (a pre-copy's
	// final pass): stopAndSave does not stop it again.
	stoppedAt time.Time
	cleanups  []func() // onFinish
}

// cleanupCtx gives a cleanup step its own budget, even once the caller's
// context has been cancelled.
func (g *sourceGuard) cleanupCtx(d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(g.ctx), d)
}

// onFinish adds f to what finish runs, success or failure, last added first:
// freeing what the migration used (the mapped-ram staging file). On failure
// it runs once the migration is cancelled and the VM continued.
func (g *sourceGuard) onFinish(f func()) { g.cleanups = append(g.cleanups, f) }

// finish is the checkpoint's deferred call, given its results: on failure
// it cancels the migration, continues the VM if it was running, runs the
// onFinish functions, adds to *err what became of the VM and clears *res;
// in any case it puts the migration settings back, last. A panic under the
// guard is such a failure (INTERNAL): the checkpoint returns it as its
// error, and the VM runs again.
func (g *sourceGuard) finish(res **CheckpointResult, err *error) {
	if v := recover(); v != nil {
		*err = errcode.Recovered(v)
	}
	defer func() {
		cctx, cancel := g.cleanupCtx(cleanupTimeout)
		defer cancel()
		g.settings(cctx)
	}()
	if !g.prepared {
		return // nothing was changed, the VM not stopped
	}
	failed := *err != nil
	// Each step gets its own budget: a migration stuck cancelling must not
	// use up the time to continue the VM.
	if failed && g.migrating {
		cctx, cancel := g.cleanupCtx(5 * time.Second)
		cancelMigration(cctx, g.mon)
		cancel()
		g.migrating = false
	}
	state := ""
	if failed && g.wasRunning {
		cctx, cancel := g.cleanupCtx(cleanupTimeout)
		if cerr := ensureRunning(cctx, g.mon); cerr != nil {
			state = fmt.Sprintf("; the VM could not be continued: %v", cerr)
		} else {
			state = "; the VM was continued"
		}
		cancel()
	}
	for i := len(g.cleanups) - 1; i >= 0; i-- {
		g.cleanups[i]()
	}
	if !failed {
		return
	}
	if g.ctx.Err() != nil && errcode.Of(*err) == errcode.Internal {
		*err = errcode.Wrap(errcode.Internal, *err, "the checkpoint was interrupted while %s (%v)%s", g.phase, context.Cause(g.ctx), state)
	} else if state != "" {
		*err = fmt.Errorf("%w%s", *err, state)
	}
	*res = nil
}

// cancelMigration cancels a migration and waits until QEMU has left it.
func cancelMigration(ctx context.Context, mon Monitor) {
	_ = mon.Execute(ctx, "migrate_cancel", nil, nil)
	for ctx.Err() == nil {
		var info migrationInfo
		if mon.Execute(ctx, "query-migrate", nil, &info) != nil {
			return
		}
		switch info.Status {
		case "active", "cancelling", "setup", "device", "pre-switchover":
			time.Sleep(50 * time.Millisecond)
			continue
		}
		return
	}
}

// ensureRunning continues the VM unless it already runs. A migration that
// completed just as the checkpoint failed must be finalized first: QEMU
// refuses cont until then.
func ensureRunning(ctx context.Context, mon Monitor) error {
	st, err := queryStatus(ctx, mon)
	if err != nil {
		return err
	}
	if st.Running {
		return nil
	}
	if st.Status == "finish-migrate" {
		if err := waitFinalized(ctx, mon); err != nil {
			return err
		}
	}
	return errcode.Ensure(errcode.QMPError, mon.Execute(ctx, "cont", nil, nil), "cont")
}
