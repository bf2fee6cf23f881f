package vmstate

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
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
