package vmstate

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// Mode says what happens to the source VM during and after a checkpoint.
type Mode string

const (
	// ModePause stops the VM and leaves it stopped once the snapshot is
	// stored: the source is about to be discarded. On failure it runs again.
	ModePause Mode = "pause"
	// ModeSnapshot stops the VM, captures it and lets it run again.
	ModeSnapshot Mode = "snapshot"
	// ModeLive uses QEMU's background-snapshot: the VM keeps running and the
	// image holds its state at the start of the checkpoint.
	ModeLive Mode = "live"
)

// ParseMode accepts the mode names of the command line.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case ModePause, ModeSnapshot, ModeLive:
		return m, nil
	}
	return "", errcode.New(errcode.Usage, "unknown mode %q: use pause, snapshot or live", s)
}

// Config is the config blob of a VM state image.
type Config struct {
	Record      Record    `json:"record"`
	Mode        Mode      `json:"mode"`
	Created     time.Time `json:"created"`
	RawBytes    int64     `json:"rawBytes"`
	Compression string    `json:"compression"`
	ChunkSize   int       `json:"chunkSize"`
}

// CheckpointOptions tunes Checkpoint. The zero value is a pause-mode
// checkpoint with default streaming.
type CheckpointOptions struct {
	Mode   Mode
	Stream StreamOptions
	// WhileStopped runs once the memory stream is complete and before the
	// VM runs again, so that what it reads (the disk overlay) agrees with
	// memory. The annotations it returns go on the state manifest. Live mode
	// does not stop the VM and refuses a WhileStopped hook.
	WhileStopped func(ctx context.Context) (map[string]string, error)
	// Annotations are added to the state manifest.
	Annotations map[string]string
}

// Durations of a checkpoint's phases.
type Durations struct {
	Prepare time.Duration // QMP queries and migration settings
	Stream  time.Duration // migration into the store
	Stopped time.Duration // WhileStopped hook
	Push    time.Duration // config and manifest
	Total   time.Duration
}

// CheckpointResult is what a checkpoint produced.
type CheckpointResult struct {
	Manifest ocispec.Descriptor
	Image    ociimage.Reference // pinned by digest
	Config   Config
	Stream   StreamResult
	// Downtime is how long the guest did not run: QEMU's figure in live
	// mode, stop to continue in snapshot mode, stop to stored in pause mode
	// (where the guest stays stopped).
	Downtime  time.Duration
	Durations Durations
	VMRunning bool // the source's state when Checkpoint returned
}

// cleanupTimeout bounds what we do to put a VM back after a failure, even
// when the caller's context has already been cancelled.
const cleanupTimeout = 30 * time.Second

// Checkpoint captures the VM behind mon into repo: it records what the VM
// is, streams its migration through a pipe into compressed chunks, and
// stores a manifest last (tagged if the reference has a tag). A VM that was
// running when Checkpoint was called runs again on any failure; only a
// successful pause-mode checkpoint leaves it stopped.
func Checkpoint(ctx context.Context, mon Monitor, repo ociimage.Repository, opts CheckpointOptions) (res *CheckpointResult, err error) {
	start := time.Now()
	if opts.Mode == "" {
		opts.Mode = ModePause
	}
	if opts.Mode == ModeLive && opts.WhileStopped != nil {
		return nil, errcode.New(errcode.Usage, "live mode does not stop the VM, so a disk overlay captured beside it would not match memory: use --mode snapshot or pause to capture the disk")
	}
	opts.Stream = opts.Stream.withDefaults()
	res = &CheckpointResult{}

	st, err := queryStatus(ctx, mon)
	if err != nil {
		return nil, err
	}
	switch st.Status {
	case "inmigrate":
		return nil, errcode.New(errcode.InvalidInput, "this QEMU is waiting for an incoming migration: there is no VM state to checkpoint yet")
	case "postmigrate", "finish-migrate":
		// A previous pause-mode checkpoint left it so: capturing again is fine.
	}
	wasRunning := st.Running

	record, err := ReadRecord(ctx, mon)
	if err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "reading the VM's compatibility record")
	}
	res.Config = Config{Record: record, Mode: opts.Mode, Created: time.Now().UTC(), Compression: "zstd", ChunkSize: opts.Stream.ChunkSize}

	restoreSettings, err := prepareMigration(ctx, mon, opts.Mode == ModeLive, true)
	if err != nil {
		return nil, err
	}
	cleanupCtx := func() (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	}
	defer func() {
		cctx, cancel := cleanupCtx()
		defer cancel()
		restoreSettings(cctx)
	}()

	var stoppedAt time.Time
	migrating := false
	defer func() {
		if err == nil {
			return
		}
		cctx, cancel := cleanupCtx()
		defer cancel()
		if migrating {
			cancelMigration(cctx, mon)
		}
		if wasRunning {
			if cerr := ensureRunning(cctx, mon); cerr != nil {
				err = fmt.Errorf("%w (and the VM could not be continued: %v)", err, cerr)
			}
		}
		res = nil
	}()

	sub := mon.Subscribe()
	defer sub.Close()

	r, w, err := os.Pipe()
	if err != nil {
		return res, errcode.Wrap(errcode.Internal, err, "creating the migration pipe")
	}
	defer r.Close()
	growPipe(r)
	fdName, err := passFile(ctx, mon, w)
	w.Close() // QEMU holds its own copy now
	if err != nil {
		return res, err
	}
	res.Durations.Prepare = time.Since(start)

	if opts.Mode != ModeLive && st.Running {
		if err = mon.Execute(ctx, "stop", nil, nil); err != nil {
			return res, errcode.Ensure(errcode.QMPError, err, "stopping the VM")
		}
		stoppedAt = time.Now()
	}

	streamStart := time.Now()
	streamCtx, stopStream := context.WithCancel(ctx)
	defer stopStream()
	finished := make(chan struct{})
	failed := make(chan error, 1)
	var (
		stream    StreamResult
		streamErr error
	)
	go func() {
		defer close(finished)
		stream, streamErr = EncodeStream(streamCtx, r, repo, opts.Stream)
		if streamErr != nil {
			failed <- streamErr
		}
	}()
	if err = mon.Execute(ctx, "migrate", map[string]any{"uri": "fd:" + fdName}, nil); err != nil {
		err = errcode.Ensure(errcode.QMPError, err, "starting the migration")
	} else {
		migrating = true
		var info migrationInfo
		info, err = waitMigration(ctx, mon, sub, failed)
		if err == nil && opts.Mode == ModeLive && info.Downtime != nil {
			res.Downtime = time.Duration(*info.Downtime) * time.Millisecond
		}
	}
	if err != nil {
		stopStream()
		r.Close() // unblocks a read waiting on QEMU
		<-finished
		return res, err
	}
	<-finished
	if err = streamErr; err != nil {
		return res, err
	}
	res.Stream = stream
	migrating = false
	res.Durations.Stream = time.Since(streamStart)
	if res.Stream.RawBytes == 0 {
		return res, errcode.New(errcode.QMPError, "QEMU reported the migration complete but wrote no state")
	}
	res.Config.RawBytes = res.Stream.RawBytes

	annotations := map[string]string{
		ociimage.AnnotationMode:        string(opts.Mode),
		ociimage.AnnotationQEMUVersion: record.QEMUVersion,
		ociimage.AnnotationMachine:     record.Machine,
		ociimage.AnnotationMemory:      strconv.FormatInt(record.MemoryBytes, 10),
		ociimage.AnnotationRawBytes:    strconv.FormatInt(res.Stream.RawBytes, 10),
		ociimage.AnnotationCreated:     res.Config.Created.Format(time.RFC3339),
	}
	for k, v := range opts.Annotations {
		annotations[k] = v
	}
	if opts.WhileStopped != nil {
		hookStart := time.Now()
		extra, herr := opts.WhileStopped(ctx)
		if herr != nil {
			return res, herr
		}
		for k, v := range extra {
			annotations[k] = v
		}
		res.Durations.Stopped = time.Since(hookStart)
	}

	if opts.Mode == ModeSnapshot && wasRunning {
		if err = mon.Execute(ctx, "cont", nil, nil); err != nil {
			return res, errcode.Ensure(errcode.QMPError, err, "continuing the VM after the snapshot")
		}
		res.Downtime = time.Since(stoppedAt)
	}

	pushStart := time.Now()
	res.Manifest, err = ociimage.PushArtifact(ctx, repo, ociimage.Artifact{
		ArtifactType:    ociimage.ArtifactTypeVMState,
		ConfigMediaType: ociimage.MediaTypeVMStateConfig,
		Config:          res.Config,
		Layers:          res.Stream.Layers,
		Annotations:     annotations,
	})
	if err != nil {
		return res, errcode.Ensure(errcode.RegistryError, err, "storing the state manifest")
	}
	res.Durations.Push = time.Since(pushStart)
	res.Image = repo.Reference().WithDigest(res.Manifest.Digest)
	if opts.Mode == ModePause && wasRunning {
		res.Downtime = time.Since(stoppedAt)
	}
	res.Durations.Total = time.Since(start)
	if st, serr := queryStatus(ctx, mon); serr == nil {
		res.VMRunning = st.Running
	}
	return res, nil
}

// prepareMigration raises the bandwidth limit (QEMU throttles migration to
// 128 MiB/s by default, which only makes sense for a running VM sharing a
// network), turns on MIGRATION events and sets background-snapshot as
// asked. The returned function puts the previous settings back.
func prepareMigration(ctx context.Context, mon Monitor, background, source bool) (func(context.Context), error) {
	var params struct {
		MaxBandwidth *int64 `json:"max-bandwidth"`
	}
	if err := mon.Execute(ctx, "query-migrate-parameters", nil, &params); err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "query-migrate-parameters")
	}
	var caps []struct {
		Capability string `json:"capability"`
		State      bool   `json:"state"`
	}
	if err := mon.Execute(ctx, "query-migrate-capabilities", nil, &caps); err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "query-migrate-capabilities")
	}
	prev := map[string]bool{}
	for _, c := range caps {
		prev[c.Capability] = c.State
	}
	want := map[string]bool{"events": true}
	if source {
		if _, ok := prev["background-snapshot"]; ok || background {
			want["background-snapshot"] = background
		}
	}
	var set, undo []map[string]any
	for c, state := range want {
		if prev[c] != state {
			set = append(set, map[string]any{"capability": c, "state": state})
			undo = append(undo, map[string]any{"capability": c, "state": prev[c]})
		}
	}
	if len(set) > 0 {
		if err := mon.Execute(ctx, "migrate-set-capabilities", map[string]any{"capabilities": set}, nil); err != nil {
			return nil, errcode.Ensure(errcode.QMPError, err, "migrate-set-capabilities")
		}
	}
	if source && params.MaxBandwidth != nil {
		if err := mon.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40}, nil); err != nil {
			return nil, errcode.Ensure(errcode.QMPError, err, "raising the migration bandwidth limit")
		}
	}
	return func(ctx context.Context) {
		// Best effort: these only matter to whoever migrates this QEMU next.
		if source && params.MaxBandwidth != nil {
			_ = mon.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": *params.MaxBandwidth}, nil)
		}
		if len(undo) > 0 {
			_ = mon.Execute(ctx, "migrate-set-capabilities", map[string]any{"capabilities": undo}, nil)
		}
	}, nil
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

// ensureRunning continues the VM unless it already runs.
func ensureRunning(ctx context.Context, mon Monitor) error {
	st, err := queryStatus(ctx, mon)
	if err != nil {
		return err
	}
	if st.Running {
		return nil
	}
	return errcode.Ensure(errcode.QMPError, mon.Execute(ctx, "cont", nil, nil), "cont")
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
