package vmstate

import (
	"context"
	"errors"
	"os"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
)

// restoreMappedRAM is Restore's mapped-ram path, from Restore, which has
// loaded and checked the image and the target: it stages the verified file,
// then has QEMU load it.
func (r *restoreRun) restoreMappedRAM(ctx context.Context, layers []ocispec.Descriptor) (out *RestoreResult, err error) {
	mon, opts, res := r.mon, r.opts, r.res
	cfg := res.Config
	dir := stagingDir(opts.StagingDir)
	// The checkpoint's bound, whatever sizes the image declares: the VM's
	// memory is the target's, which matches it (checkRestorable).
	ctx, abort := context.WithCancelCause(ctx)
	defer abort(nil)
	staging, err := newStagingFile(dir, os.O_RDONLY, mon, cfg.Record.MemoryBytes, opts.StagingOwner, abort)
	if err != nil {
		return nil, err
	}
	defer func() {
		// Last, so that QEMU 9.0 closes its descriptor: it does only while
		// the VM runs, that is once finish has continued it. QEMU
		// reads the file: one that holds it open for writing now fails the
		// restore; one that keeps reading it (9.0, paused) is let be.
		serr := staging.settle(ctx, err != nil)
		if werr := staging.exceeded(); werr != nil {
			serr = werr
		}
		if err == nil && serr != nil {
			out, err = nil, serr
		}
	}()
	f := staging.file()
	if err := f.Truncate(cfg.RawBytes); err != nil {
		return nil, stagingError(dir, err, "sizing the staging file")
	}
	res.Durations.Prepare = time.Since(r.start)

	// Every chunk is verified before it is written, and QEMU sees the file
	// only once all of them are: a bad chunk leaves the target untouched.
	streamStart := time.Now()
	n, err := chunk.DecodeStream(ctx, layers, r.repo, &sparseWriter{f: f}, opts.Stream)
	if err != nil {
		// A failed write names the staging file; a failed read from the
		// store is reported as it is.
		var perr *os.PathError
		if errors.As(err, &perr) && perr.Path == f.Name() {
			return nil, stagingError(dir, err, "writing the staging file")
		}
		return nil, err
	}
	if n != cfg.RawBytes {
		return nil, errcode.New(errcode.InvalidInput, "the image's chunks hold %d bytes, its config declares %d", n, cfg.RawBytes)
	}
	res.RawBytes = n

	if _, err := prepareMigration(ctx, mon, migrationSettings{mappedRAM: true}); err != nil {
		return nil, err // a target is discarded on failure: its settings need no undo
	}
	sub := mon.Subscribe()
	defer sub.Close()
	if err := staging.pass(ctx); err != nil {
		return nil, err
	}
	if err := mon.Execute(ctx, "migrate-incoming", map[string]string{"uri": staging.uri()}, nil); err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "starting the incoming migration from the staging file")
	}
	if _, err := waitMigration(ctx, mon, sub, nil); err != nil {
		// Whatever QEMU made of the file, it must not run it.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		_ = mon.Execute(cctx, "quit", nil, nil)
		cancel()
		return nil, errcode.Wrap(errcode.Of(err), err, "QEMU failed to load the verified state, so it was told to quit: start a new one to try again")
	}
	staging.free() // QEMU has loaded it
	res.Durations.Stream = time.Since(streamStart)
	return r.finish(ctx)
}
