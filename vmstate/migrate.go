package vmstate

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
	"time"

	goqmp "github.com/digitalocean/go-qemu/qmp"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp"
)

// Monitor is the part of the QMP client that capture and restore use.
// *qmp.Client implements it.
type Monitor interface {
	Executor
	ExecuteWithFile(ctx context.Context, command string, args, result any, f *os.File) error
	Subscribe() *qmp.Subscription
}

// migrationInfo is the part of query-migrate we read.
type migrationInfo struct {
	Status    string `json:"status"`
	ErrorDesc string `json:"error-desc"`
	Downtime  *int64 `json:"downtime"` // ms, once completed
	TotalTime *int64 `json:"total-time"`
	RAM       *struct {
		Transferred int64 `json:"transferred"`
		Total       int64 `json:"total"`
	} `json:"ram"`
}

// passFile hands f to QEMU under a fresh name (getfd over SCM_RIGHTS), so
// that "fd:NAME" URIs can use it. It returns the name.
func passFile(ctx context.Context, mon Monitor, f *os.File) (string, error) {
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "vmsnap-" + hex.EncodeToString(b[:])
	if err := mon.ExecuteWithFile(ctx, "getfd", map[string]string{"fdname": name}, nil, f); err != nil {
		return "", errcode.Ensure(errcode.QMPError, err, "passing the migration pipe to QEMU")
	}
	return name, nil
}

// growPipe asks for a larger pipe buffer so QEMU and the reader wake each
// other less often. Failing is harmless.
func growPipe(f *os.File) {
	const fSetPipeSz = 1031 // F_SETPIPE_SZ
	if rc, err := f.SyscallConn(); err == nil {
		_ = rc.Control(func(fd uintptr) {
			_, _, _ = syscall.Syscall(syscall.SYS_FCNTL, fd, fSetPipeSz, 1<<20)
		})
	}
}

// outgoingPipe is a pipe a source QEMU migrates into: its write end
// passed to QEMU (getfd) ahead of the migration, so that passing it costs
// no downtime, vmsnap reading the other.
type outgoingPipe struct {
	r      *os.File
	fdName string
	taken  bool // a migrate command took QEMU's descriptor
}

func openOutgoingPipe(ctx context.Context, mon Monitor) (*outgoingPipe, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "creating the migration pipe")
	}
	growPipe(r)
	name, err := passFile(ctx, mon, w)
	w.Close() // QEMU holds its own copy now
	if err != nil {
		r.Close()
		return nil, err
	}
	return &outgoingPipe{r: r, fdName: name}, nil
}

// close closes vmsnap's end, and QEMU's descriptor if no migration took
// it (QEMU would hold it open forever).
func (p *outgoingPipe) close(mon Monitor, g *sourceGuard) {
	p.r.Close()
	if !p.taken {
		cctx, cancel := g.cleanupCtx(5 * time.Second)
		_ = mon.Execute(cctx, "closefd", map[string]string{"fdname": p.fdName}, nil)
		cancel()
	}
}

// migrate runs QEMU's migration into the pipe, consume reading all of it
// on its own goroutine. A consume error breaks the pipe at once: QEMU may
// be blocked writing into the full pipe while it holds its big lock (the
// final pass of a migration does), and then its monitor answers nothing.
// It returns once QEMU completed and consume has read to the end, with the
// final query-migrate. On an error it returns the cause (consume's, when
// our side failed first and QEMU's failure is only the broken pipe that
// followed), the migration possibly still on: g.migrating says so.
func (p *outgoingPipe) migrate(ctx context.Context, mon Monitor, g *sourceGuard, sub *qmp.Subscription, consume func(context.Context, io.Reader) error) (migrationInfo, error) {
	cctx, stopConsume := context.WithCancel(ctx)
	defer stopConsume()
	finished := make(chan struct{})
	failed := make(chan error, 1)
	var consumeErr error
	go func() {
		defer close(finished)
		// Safely: consume reads what QEMU sends, in a goroutine.
		if consumeErr = errcode.Safely(func() error { return consume(cctx, p.r) }); consumeErr != nil {
			p.r.Close()
			failed <- consumeErr
		}
	}()
	fail := func(err error) (migrationInfo, error) {
		stopConsume()
		p.r.Close() // unblocks a read waiting on QEMU
		<-finished
		if consumeErr != nil && !errors.Is(consumeErr, context.Canceled) {
			err = consumeErr
		}
		return migrationInfo{}, err
	}
	// Set before asking: if the reply is lost, the migration may still run.
	g.migrating = true
	if err := mon.Execute(ctx, "migrate", map[string]any{"uri": "fd:" + p.fdName}, nil); err != nil {
		return fail(errcode.Ensure(errcode.QMPError, err, "starting the migration"))
	}
	p.taken = true
	info, err := waitMigration(ctx, mon, sub, failed)
	if err != nil {
		return fail(err)
	}
	// QEMU closes its end once done; if it hangs instead, the caller's
	// deadline still ends the read.
	unblock := context.AfterFunc(ctx, func() { p.r.Close() })
	<-finished
	unblock()
	g.migrating = false // QEMU completed it
	return info, consumeErr
}

// waitMigration waits until the migration on this monitor ends, from its
// MIGRATION events, polling query-migrate as a fallback for a lost event.
// streamDone, if not nil, reports our end of the pipe: an error there ends
// the wait at once. It returns the final query-migrate.
func waitMigration(ctx context.Context, mon Monitor, sub *qmp.Subscription, streamDone <-chan error) (migrationInfo, error) {
	poll := time.NewTicker(500 * time.Millisecond)
	defer poll.Stop()
	// The verdict comes from a MIGRATION event or, if one was lost, from
	// polling; query-migrate adds the details either way.
	verdict := func(status string) (migrationInfo, bool, error) {
		var info migrationInfo
		// While QEMU writes the final pass into a pipe it holds its big lock
		// and its monitor does not answer: a poll that times out means
		// "still busy", not failure.
		qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := mon.Execute(qctx, "query-migrate", nil, &info)
		cancel()
		switch {
		case err == nil:
		case ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) && status == "":
			return info, false, nil
		case ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded):
			// The event's verdict stands without query-migrate's details.
		default:
			return info, true, errcode.Ensure(errcode.QMPError, err, "query-migrate")
		}
		if status == "" {
			status = info.Status
		}
		switch status {
		case "completed":
			return info, true, nil
		case "failed", "cancelled":
			msg := info.ErrorDesc
			if msg == "" {
				msg = "no reason given (see QEMU's log)"
			}
			return info, true, errcode.New(errcode.QMPError, "QEMU's migration %s: %s", status, msg)
		}
		return info, false, nil
	}
	for {
		status := ""
		select {
		case <-ctx.Done():
			return migrationInfo{}, context.Cause(ctx)
		case err := <-streamDone:
			if err != nil {
				return migrationInfo{}, err
			}
			streamDone = nil // our side is done; QEMU's verdict follows
			continue
		case ev, ok := <-sub.C():
			if !ok {
				return migrationInfo{}, errcode.New(errcode.QMPError, "QEMU closed the monitor connection during the migration")
			}
			if !isMigrationEnd(ev) {
				continue
			}
			status = fmt.Sprint(ev.Data["status"])
		case <-poll.C:
		}
		if info, done, err := verdict(status); done {
			return info, err
		}
	}
}

func isMigrationEnd(ev goqmp.Event) bool {
	if ev.Event != "MIGRATION" {
		return false
	}
	switch fmt.Sprint(ev.Data["status"]) {
	case "completed", "failed", "cancelled":
		return true
	}
	return false
}

// runState is the part of query-status we read.
type runState struct {
	Status  string `json:"status"`
	Running bool   `json:"running"`
}

func queryStatus(ctx context.Context, mon Executor) (runState, error) {
	var st runState
	err := mon.Execute(ctx, "query-status", nil, &st)
	return st, errcode.Ensure(errcode.QMPError, err, "query-status")
}
