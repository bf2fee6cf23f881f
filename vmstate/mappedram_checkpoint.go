package vmstate

import (
	"context"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp"
)

// checkpointMappedRAM is Checkpoint's mapped-ram path: QEMU saves the
// stopped VM into a staging file, which is chunked once the VM runs again.
func (r *checkpointRun) checkpointMappedRAM(ctx context.Context) (out *CheckpointResult, err error) {
	r.res.Config.Format = FormatMappedRAM
	g, err := r.guard(ctx, migrationSettings{source: true, mappedRAM: true})
	defer g.finish(&out, &err)
	if err != nil {
		return nil, err
	}

	sub := r.mon.Subscribe()
	defer sub.Close()

	// From the file's creation on, it must not hold more than the VM's
	// memory explains: past that, its guard empties it and cancels ctx
	// with its error, which the checkpoint returns.
	ctx, abort := context.WithCancelCause(ctx)
	defer abort(nil)
	staging, err := newStagingFile(stagingDir(r.opts.StagingDir), os.O_WRONLY, r.mon, r.res.Config.Record.MemoryBytes, r.opts.StagingOwner, abort)
	if err != nil {
		return nil, err
	}
	// On failure, once the guard has cancelled the migration: the file is
	// emptied and kept so (the checkpoint fails anyway).
	g.onFinish(func() { _ = staging.settle(ctx, true) })
	defer func() {
		if werr := staging.exceeded(); werr != nil {
			err = werr
		}
	}()
	if err = staging.pass(ctx); err != nil {
		return nil, err
	}
	if err = r.stopAndSave(ctx, &mappedRAMCapture{checkpointRun: r, sub: sub, staging: staging}); err != nil {
		return nil, err
	}
	return r.res, nil
}

// mappedRAMCapture is the mapped-ram format's capture: save has QEMU
// write the stopped VM into the staging file, store chunks that file at
// fixed offsets.
type mappedRAMCapture struct {
	*checkpointRun
	sub     *qmp.Subscription
	staging *stagingFile
	// size and allocated are the staging file's, once QEMU wrote it.
	size, allocated int64
}

func (c *mappedRAMCapture) save(ctx context.Context) error {
	c.g.phase = "saving the VM state into the staging file"
	saveStart := time.Now()
	if err := migrateIntoStaging(ctx, c.mon, c.g, c.sub, c.staging); err != nil {
		return err
	}
	if err := waitFinalized(ctx, c.mon); err != nil {
		return err
	}
	c.res.Durations.Save = time.Since(saveStart)
	var err error
	c.size, c.allocated, err = checkExtent(c.staging.file(), c.res.Config.Record.MemoryBytes)
	if errcode.Of(err) == errcode.QMPError {
		return err
	} else if err != nil {
		return stagingError(stagingDir(c.opts.StagingDir), err, "reading the staging file")
	}
	if c.size == 0 {
		return errcode.New(errcode.QMPError, "QEMU reported the migration complete but wrote no state")
	}
	return nil
}

// store runs once the state is in the file: the VM need not wait for the
// upload.
func (c *mappedRAMCapture) store(ctx context.Context) error {
	res := c.res
	// QEMU is done with the file.
	c.staging.dropFDSet(ctx)
	c.g.phase = "storing the VM state"
	streamStart := time.Now()
	so := c.opts.Stream
	so.Fixed = true
	var err error
	res.Stream, err = chunk.EncodeStream(ctx, &sparseReader{f: c.staging.file(), size: c.size}, c.repo, so)
	if err != nil {
		return err
	}
	if res.Stream.RawBytes != c.size {
		return errcode.New(errcode.Internal, "read %d bytes of the %d-byte staging file", res.Stream.RawBytes, c.size)
	}
	res.Durations.Stream = res.Durations.Save + time.Since(streamStart)
	res.Config.RawBytes = c.size
	res.Config.DataBytes = c.allocated
	if err = c.staging.exceeded(); err != nil {
		return err
	}
	// QEMU 9.0 keeps its descriptor while the VM is stopped; any QEMU
	// closes it at remove-fd while the VM runs.
	mayKeep := keepsRemovedFDs(res.Config.Record.QEMUVersion) && !(c.opts.Mode == ModeSnapshot && c.st.Running)
	// Before the tag: a QEMU that still writes into the file fails it.
	return c.staging.settle(ctx, mayKeep)
}

// migrateIntoStaging has QEMU migrate the VM's state into the staging
// file and waits for the migration to complete. A QEMU that ran out of
// room says so only in its error's text: that becomes the staging file's
// error, which tells what to do.
func migrateIntoStaging(ctx context.Context, mon Monitor, g *sourceGuard, sub *qmp.Subscription, staging *stagingFile) error {
	g.migrating = true // set before asking: if the reply is lost, the migration may still run
	if err := mon.Execute(ctx, "migrate", map[string]any{"uri": staging.uri()}, nil); err != nil {
		return errcode.Ensure(errcode.QMPError, err, "starting the migration into the staging file")
	}
	if _, err := waitMigration(ctx, mon, sub, nil); err != nil {
		switch desc := err.Error(); {
		case strings.Contains(desc, "No space left"):
			err = staging.qemuFull(syscall.ENOSPC)
		case strings.Contains(desc, "quota exceeded"):
			err = staging.qemuFull(syscall.EDQUOT)
		}
		return err
	}
	g.migrating = false
	return nil
}
