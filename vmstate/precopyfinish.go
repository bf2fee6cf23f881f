package vmstate

import (
	"bufio"
	"context"
	"io"
	"os"
	"time"

	goqmp "github.com/digitalocean/go-qemu/qmp"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// precopyParser reads QEMU's pre-copy stream: the RAM file's pages into
// the shadow, the device state into devices.
//
// Bounds: the RAM file's pages are rewritten in place, so a QEMU that
// sends them again and again is cut off at three times the file plus the
// most state a VM of its size may have. The staging files hold at most
// that state: the pages at their offsets in the shadow (the file's size at
// most), and the device state in what is left (and 1 GiB).
func precopyParser(be *RAMBackend, addr uint64, sh *ramfile.Shadow, devices *os.File) func(context.Context, io.Reader) error {
	return func(_ context.Context, r io.Reader) error {
		br := bufio.NewReaderSize(&boundedStream{r: r, left: 3*be.Bytes + maxStateBytes(be.Bytes), tooMuch: func() error {
			return streamErr("QEMU sent more than a pre-copy of this VM may take")
		}}, 1<<20)
		bw := bufio.NewWriterSize(&limitedWriter{w: devices, left: min(maxPrecopyDevices, maxStateBytes(be.Bytes)-be.Bytes)}, 1<<20)
		err := readPrecopy(br, bw, be.ID, be.Bytes, addr, sh)
		if err == nil {
			// The devices, copied as they are, to the end.
			if _, cerr := io.Copy(bw, br); cerr != nil {
				err = errcode.Ensure(errcode.QMPError, cerr, "reading QEMU's pre-copy stream")
			}
		}
		if ferr := bw.Flush(); ferr != nil && err == nil {
			err = errcode.Ensure(errcode.Internal, ferr, "writing the device state's staging file")
		}
		return err
	}
}

// precopyStoppedAt checks, once the pre-copy completed, that QEMU stopped
// the VM: it must still be stopped (the disk is captured next, and must
// match), and it stopped with the last STOP event QEMU sent (one per stop:
// an earlier stop someone else made and undid does not count), already
// queued once the completion was seen.
func precopyStoppedAt(ctx context.Context, mon Monitor, events *qmp.Subscription) (time.Time, error) {
	var stoppedAt time.Time
	if st, err := queryStatus(ctx, mon); err != nil {
		return stoppedAt, err
	} else if st.Running {
		return stoppedAt, errcode.New(errcode.QMPError, "QEMU completed the pre-copy, but the VM is running (status %s): memory and disk would not match", st.Status)
	}
	for wait := 2 * time.Second; ; wait = 20 * time.Millisecond {
		wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), wait)
		ev, err := events.Wait(wctx, func(ev goqmp.Event) bool { return ev.Event == "STOP" })
		cancel()
		if err != nil {
			break
		}
		at := time.Unix(ev.Timestamp.Seconds, ev.Timestamp.Microseconds*1000)
		if now := time.Now(); at.After(now) || now.Sub(at) > time.Minute {
			at = now // a clock QEMU does not share
		}
		stoppedAt = at
	}
	if stoppedAt.IsZero() {
		return stoppedAt, errcode.New(errcode.QMPError, "QEMU completed the pre-copy without a STOP event")
	}
	return stoppedAt, nil
}

// finish completes a pre-copy's capture with the VM stopped: the pages
// QEMU did not send read from f, the device state rewound for reading.
func (p *precopied) finish(sh *ramfile.Shadow, f *os.File) (err error) {
	if p.unsent, err = sh.FillUnsent(f); err != nil {
		return err
	}
	if p.deviceLen, err = p.devices.Seek(0, io.SeekCurrent); err != nil {
		return errcode.Wrap(errcode.Internal, err, "reading the device state's staging file")
	}
	if _, err := p.devices.Seek(0, io.SeekStart); err != nil {
		return errcode.Wrap(errcode.Internal, err, "reading the device state's staging file")
	}
	p.capture, err = sh.Capture()
	return err
}
