package vmstate

import (
	"context"
	"io"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp"
)

// checkpointStream is Checkpoint's stream path: QEMU migrates the VM
// through a pipe into the chunk codec.
func (r *checkpointRun) checkpointStream(ctx context.Context) (out *CheckpointResult, err error) {
	// Background snapshot would start a paused VM when it ends; a paused VM
	// needs no background snapshot anyway.
	background := r.opts.Mode == ModeLive && r.st.Running
	stoppedMemory := int64(0) // the VM will not run during the migration
	if !background {
		stoppedMemory = r.res.Config.Record.MemoryBytes
	}
	g, err := r.guard(ctx, migrationSettings{source: true, background: background, stoppedMemory: stoppedMemory})
	defer g.finish(&out, &err)
	if err != nil {
		return nil, err
	}
	s, err := r.newStreamCapture(ctx)
	if err != nil {
		return nil, err
	}
	defer s.close()
	if err = r.stopAndSave(ctx, s); err != nil {
		return nil, err
	}
	return r.res, nil
}

// streamCapture is QEMU's migration into a pipe that the chunk codec
// reads into res.Stream: the whole state for the stream format, the device
// state for a memory-file checkpoint that no pre-copy carried.
type streamCapture struct {
	*checkpointRun
	sub  *qmp.Subscription
	pipe *outgoingPipe
}

// newStreamCapture readies the migration: it subscribes to QEMU's events
// and passes QEMU the pipe. Close what it returns once the checkpoint is
// over.
func (r *checkpointRun) newStreamCapture(ctx context.Context) (*streamCapture, error) {
	sub := r.mon.Subscribe()
	pipe, err := openOutgoingPipe(ctx, r.mon)
	if err != nil {
		sub.Close()
		return nil, err
	}
	return &streamCapture{checkpointRun: r, sub: sub, pipe: pipe}, nil
}

func (s *streamCapture) close() {
	s.pipe.close(s.mon, s.g)
	s.sub.Close()
}

// save runs the migration and stores the stream's chunks as they come.
func (s *streamCapture) save(ctx context.Context) error {
	res := s.res
	streamStart := time.Now()
	var stream chunk.StreamResult
	s.g.phase = "streaming the VM state"
	info, err := s.pipe.migrate(ctx, s.mon, s.g, s.sub, func(ctx context.Context, r io.Reader) (err error) {
		stream, err = chunk.EncodeStream(ctx, newBoundedStream(r, res.Config.Record.MemoryBytes), s.repo, s.opts.Stream)
		return err
	})
	if err != nil {
		return err
	}
	if s.opts.Mode == ModeLive && info.Downtime != nil {
		res.Downtime = time.Duration(*info.Downtime) * time.Millisecond
	}
	res.Stream = stream
	res.Durations.Stream = time.Since(streamStart)
	if res.Stream.RawBytes == 0 {
		return errcode.New(errcode.QMPError, "QEMU reported the migration complete but wrote no state")
	}
	res.Config.RawBytes = res.Stream.RawBytes
	return nil
}

// store has nothing left to do: save stored the stream as QEMU sent it.
func (s *streamCapture) store(context.Context) error { return nil }
