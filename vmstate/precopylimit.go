package vmstate

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// precopyLimit holds a pre-copy's departures from the guard's migration
// settings: x-ignore-shared off and a downtime limit of its own. The limit
// is set by the pre-copy and by its force timer; whichever comes last,
// restore puts the guard's limit back after both.
type precopyLimit struct {
	mon   Monitor
	saved int64 // the guard's downtime limit
	mu    sync.Mutex
	done  bool
}

// setIgnoreShared turns QEMU's x-ignore-shared capability on or off.
func setIgnoreShared(ctx context.Context, mon Monitor, on bool) error {
	return errcode.Ensure(errcode.QMPError, mon.Execute(ctx, "migrate-set-capabilities", map[string]any{
		"capabilities": []map[string]any{{"capability": capIgnoreShared, "state": on}}}, nil), "setting %s", capIgnoreShared)
}

// enterPrecopySettings reads the guard's downtime limit and turns
// x-ignore-shared off; the caller defers restore once it succeeded.
func enterPrecopySettings(ctx context.Context, mon Monitor) (*precopyLimit, error) {
	var params struct {
		DowntimeLimit *int64 `json:"downtime-limit"`
	}
	if err := mon.Execute(ctx, "query-migrate-parameters", nil, &params); err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "query-migrate-parameters")
	}
	if params.DowntimeLimit == nil {
		return nil, errcode.New(errcode.QMPError, "QEMU reports no downtime-limit")
	}
	if err := setIgnoreShared(ctx, mon, false); err != nil {
		return nil, err
	}
	return &precopyLimit{mon: mon, saved: *params.DowntimeLimit}, nil
}

// set sets the downtime limit, unless restore has put it back already.
func (l *precopyLimit) set(ctx context.Context, ms int64) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.done {
		return nil
	}
	return l.mon.Execute(ctx, "migrate-set-parameters", map[string]any{"downtime-limit": ms}, nil)
}

// restore goes back to the guard's settings, which it puts back in turn.
// A checkpoint that cannot have x-ignore-shared back must not go on: its
// device state would carry the whole RAM (errNoFallback joins *errp).
func (l *precopyLimit) restore(g *sourceGuard, errp *error) {
	cctx, cancel := g.cleanupCtx(10 * time.Second)
	defer cancel()
	l.mu.Lock()
	l.done = true
	_ = l.mon.Execute(cctx, "migrate-set-parameters", map[string]any{"downtime-limit": l.saved}, nil)
	l.mu.Unlock()
	if serr := setIgnoreShared(cctx, l.mon, true); serr != nil {
		*errp = errors.Join(*errp, errNoFallback, serr)
	}
}
