package vmstate

import (
	"context"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// migrationSettings says what kind of migration prepareMigration sets up.
type migrationSettings struct {
	source     bool // the sending side (else a restore target)
	background bool // background-snapshot: the VM runs on
	// stoppedMemory, if not 0, is the memory of a VM that stays stopped
	// during the whole migration.
	stoppedMemory int64
	// mappedRAM turns on mapped-ram and multifd (and, on the source, sets
	// multifd-channels): a migration into or from a file (mappedram.go).
	mappedRAM bool
	// ignoreShared turns on x-ignore-shared: a shared RAM file's pages
	// stay out of the migration (memfile.go).
	ignoreShared bool
}

// prepareMigration makes the next migration a plain precopy stream into one
// descriptor: it turns off every capability but MIGRATION events (and
// background-snapshot, when asked for), since others (multifd, return-path,
// postcopy, block, pause-before-switchover, validate-uuid, ...) either need
// more channels than our pipe, a peer that answers, or a target configured
// alike.
//
// On the source it also sets the pace. A running VM (live mode) gets an
// unlimited bandwidth: QEMU's default of 128 MiB/s only makes sense for a VM
// sharing a network. A stopped VM gets the opposite: a low bandwidth and the
// highest downtime limit, which makes QEMU skip the iterative phase after
// its first bandwidth estimate and send all of memory in one unthrottled
// final pass. That is faster, and it lays out the stream the same way every
// time, so that a second checkpoint of an unchanged VM produces the same
// chunks (which the store already has) instead of a stream shifted by
// section markers placed by timing.
//
// The returned function puts the previous settings back; it is never nil,
// even with an error, and undoes whatever was changed.
func prepareMigration(ctx context.Context, mon Monitor, set migrationSettings) (func(context.Context), error) {
	var undoCaps []map[string]any
	var undoParams map[string]any
	undo := func(ctx context.Context) {
		// Best effort: these only matter to whoever migrates this QEMU next.
		if len(undoParams) > 0 {
			_ = mon.Execute(ctx, "migrate-set-parameters", undoParams, nil)
		}
		if len(undoCaps) > 0 {
			_ = mon.Execute(ctx, "migrate-set-capabilities", map[string]any{"capabilities": undoCaps}, nil)
		}
	}
	var err error
	if undoCaps, err = setCapabilities(ctx, mon, set); err != nil || !set.source {
		return undo, err
	}
	undoParams, err = setSourceParameters(ctx, mon, set)
	return undo, err
}

// setCapabilities turns on the capabilities set asks for and every other
// off; it returns what puts them back (nil with an error: nothing changed).
func setCapabilities(ctx context.Context, mon Monitor, set migrationSettings) ([]map[string]any, error) {
	var caps []struct {
		Capability string `json:"capability"`
		State      bool   `json:"state"`
	}
	if err := mon.Execute(ctx, "query-migrate-capabilities", nil, &caps); err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "query-migrate-capabilities")
	}
	var change, revert []map[string]any
	for _, c := range caps {
		want := false
		switch c.Capability {
		case "events":
			want = true
		case "background-snapshot":
			want = set.background && set.source
		case capMappedRAM, capMultifd:
			want = set.mappedRAM
		case capIgnoreShared:
			want = set.ignoreShared
		}
		if c.State != want {
			change = append(change, map[string]any{"capability": c.Capability, "state": want})
			revert = append(revert, map[string]any{"capability": c.Capability, "state": c.State})
		}
	}
	if len(change) > 0 {
		if err := mon.Execute(ctx, "migrate-set-capabilities", map[string]any{"capabilities": change}, nil); err != nil {
			return nil, errcode.Ensure(errcode.QMPError, err, "setting the migration capabilities")
		}
	}
	return revert, nil
}

// setSourceParameters sets the source's pace (and multifd channels); it
// returns the previous values of what it changed (nil with an error:
// nothing changed).
func setSourceParameters(ctx context.Context, mon Monitor, set migrationSettings) (map[string]any, error) {
	var params struct {
		MaxBandwidth    *int64 `json:"max-bandwidth"`
		DowntimeLimit   *int64 `json:"downtime-limit"`
		MultifdChannels *int64 `json:"multifd-channels"`
	}
	if err := mon.Execute(ctx, "query-migrate-parameters", nil, &params); err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "query-migrate-parameters")
	}
	want := map[string]any{}
	if params.MaxBandwidth != nil {
		want["max-bandwidth"] = int64(1) << 40
	}
	if set.stoppedMemory > 0 && params.MaxBandwidth != nil && params.DowntimeLimit != nil {
		// QEMU completes once what is left fits in bandwidth x downtime
		// limit: make sure all of memory does, with room to spare.
		const maxDowntimeMs = 2000000 // the largest QEMU accepts
		want["downtime-limit"] = int64(maxDowntimeMs)
		want["max-bandwidth"] = max(int64(1)<<20, set.stoppedMemory/(maxDowntimeMs/1000/2))
	}
	if set.mappedRAM && params.MultifdChannels != nil {
		want["multifd-channels"] = multifdChannels()
	}
	if len(want) == 0 {
		return nil, nil
	}
	if err := mon.Execute(ctx, "migrate-set-parameters", want, nil); err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "setting the migration parameters")
	}
	undo := map[string]any{}
	if _, ok := want["max-bandwidth"]; ok {
		undo["max-bandwidth"] = *params.MaxBandwidth
	}
	if _, ok := want["downtime-limit"]; ok {
		undo["downtime-limit"] = *params.DowntimeLimit
	}
	if _, ok := want["multifd-channels"]; ok {
		undo["multifd-channels"] = *params.MultifdChannels
	}
	return undo, nil
}
