package vmstate

import (
	"context"
	"io"
	"os"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
)

// restoreStream is Restore's path for the stream, and for a memory-file
// image's device state: the verified chunks are fed into QEMU's incoming
// migration through a pipe.
func (r *restoreRun) restoreStream(ctx context.Context, layers []ocispec.Descriptor) (*RestoreResult, error) {
	mon, res := r.mon, r.res
	// A memory-file image's RAM is the file the target maps (Prepare):
	// only the device state goes through the stream.
	stream, _, err := res.Config.checkRAM(layers)
	if err != nil {
		return nil, err
	}
	if _, err := prepareMigration(ctx, mon, migrationSettings{ignoreShared: res.Config.Format == FormatMemoryFile}); err != nil {
		// A target is discarded on failure: its settings need no undo.
		return nil, err
	}
	sub := mon.Subscribe()
	defer sub.Close()
	res.Durations.Prepare = time.Since(r.start)

	streamStart := time.Now()
	if res.RawBytes, err = r.feed(ctx, stream); err != nil {
		return nil, err
	}
	if _, err := waitMigration(ctx, mon, sub, nil); err != nil {
		return nil, err
	}
	res.Durations.Stream = time.Since(streamStart)
	return r.finish(ctx)
}

// feed decodes the stream's chunks into a pipe whose other end QEMU loads
// (migrate-incoming fd:), started once the first chunk is verified. A
// QEMU that got part of a stream is told to quit.
func (r *restoreRun) feed(ctx context.Context, stream []ocispec.Descriptor) (int64, error) {
	mon := r.mon
	pr, w, err := os.Pipe()
	if err != nil {
		return 0, errcode.Wrap(errcode.Internal, err, "creating the migration pipe")
	}
	defer w.Close()
	growPipe(w)
	in := &lazyIncoming{w: w, start: func() error {
		name, err := passFile(ctx, mon, pr)
		pr.Close() // QEMU holds its own copy now
		if err != nil {
			return err
		}
		if err := mon.Execute(ctx, "migrate-incoming", map[string]string{"uri": "fd:" + name}, nil); err != nil {
			_ = mon.Execute(ctx, "closefd", map[string]string{"fdname": name}, nil)
			return errcode.Ensure(errcode.QMPError, err, "starting the incoming migration")
		}
		return nil
	}}
	// A QEMU that stops reading must not hold us past the caller's deadline.
	unblock := context.AfterFunc(ctx, func() { _ = w.SetWriteDeadline(time.Unix(1, 0)) })
	n, err := chunk.DecodeStream(ctx, stream, r.repo, in, r.opts.Stream)
	unblock()
	w.Close() // end of stream for QEMU: it loads what it has and finishes or fails
	if !in.started {
		pr.Close()
		if err == nil {
			err = errcode.New(errcode.InvalidInput, "the image holds no VM state")
		}
	}
	if err != nil {
		if in.started {
			// QEMU has part of a stream. If the cut fell after the stream's
			// end marker it may even load and run it: make sure it does not.
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			_ = mon.Execute(cctx, "quit", nil, nil)
			cancel()
			return 0, errcode.Wrap(errcode.Of(err), err, "the restore stopped part-way, so the waiting QEMU was told to quit: start a new one to try again")
		}
		return 0, err
	}
	return n, nil
}

// lazyIncoming starts QEMU's incoming migration on the first write, that is
// once the first chunk has been fetched and verified.
type lazyIncoming struct {
	w       io.Writer
	start   func() error
	started bool
}

func (l *lazyIncoming) Write(p []byte) (int, error) {
	if !l.started {
		l.started = true
		if err := l.start(); err != nil {
			return 0, err
		}
	}
	n, err := l.w.Write(p)
	if err != nil {
		err = errcode.Wrap(errcode.QMPError, err, "QEMU stopped reading the state stream (see QEMU's log for why)")
	}
	return n, err
}
