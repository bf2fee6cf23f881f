package vmstate

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

// Mode is vmspec.Mode, by the name vmstate's own code uses (one type:
// defined in the leaf so that agent/api carries it without vmstate).
type Mode = vmspec.Mode

// The modes (vmspec).
const (
	ModePause    = vmspec.ModePause
	ModeSnapshot = vmspec.ModeSnapshot
	ModeLive     = vmspec.ModeLive
)

// Config is the config blob of a VM state image.
type Config struct {
	Record      Record    `json:"record"`
	Mode        Mode      `json:"mode"`
	Created     time.Time `json:"created"`
	RawBytes    int64     `json:"rawBytes"`
	Compression string    `json:"compression"`
	ChunkSize   int       `json:"chunkSize"`
	// Format is how the chunks hold the state: empty for QEMU's stream
	// (every image before formats existed), FormatMappedRAM for QEMU's
	// mapped-ram file, chunked at fixed offsets of ChunkSize.
	Format Format `json:"format,omitempty"`
	// DataBytes is, for a mapped-ram file, how much of RawBytes is data
	// rather than holes: the space a restore needs to stage it.
	DataBytes int64 `json:"dataBytes,omitempty"`
	// RAM is, for FormatMemoryFile, the RAM file beside the device state
	// (RawBytes): its size and the chain of checkpoints its layers
	// come from.
	RAM *RAMConfig `json:"ram,omitempty"`
}

// CheckpointOptions tunes Checkpoint. The zero value is a pause-mode
// checkpoint with default streaming.
type CheckpointOptions struct {
	Mode   Mode
	Stream chunk.StreamOptions
	// WhileStopped runs once the memory stream is complete and before the
	// VM runs again, so that what it reads (the disk overlay) agrees with
	// memory. What it returns goes into the checkpoint index beside the
	// state manifest: the images it stored. Live mode does not stop the VM
	// and refuses a WhileStopped hook.
	WhileStopped func(ctx context.Context) (Link, error)
	// Annotations are added to the checkpoint index.
	Annotations map[string]string
	// Commit runs once the state manifest and the checkpoint index are
	// stored, as the last step of a checkpoint that has stored everything:
	// it moves the tags of the checkpoint's images (ociimage.TagManifest),
	// the checkpoint index's last. Every manifest is stored by digest
	// (PutManifest never tags), so a failure before Commit leaves every tag
	// where it was. Without Commit, the tag of the reference Checkpoint's
	// repository was opened from, if any, moves to the checkpoint index. A
	// Commit error fails the checkpoint like any other.
	Commit func(ctx context.Context, checkpoint ocispec.Descriptor) error
	// Format is how the state is captured: FormatAuto (the zero value),
	// FormatStream or FormatMappedRAM (see mappedram.go).
	Format Format
	// StagingDir is where a mapped-ram checkpoint has QEMU write its file,
	// and where a memory-file checkpoint sets the changed pages aside
	// while the VM is stopped (default $TMPDIR).
	StagingDir string
	// StagingOwner is whose operation this is (the agent: the VM's
	// namespace): staging files that QEMUs keep after their operations
	// count per owner (maxKeptStaging).
	StagingOwner string
	// Parent, for FormatMemoryFile, is the manifest (in the same
	// repository) whose RAM file this checkpoint stores the changes to,
	// checked against the VM's memory unless Records holds it. Nil: the
	// checkpoint Records holds for this VM, if it can be one.
	Parent *ocispec.Descriptor
	// Records, for FormatMemoryFile, is where the node keeps each VM's
	// last checkpoint, the parent of its next (parentrecord.go). Nil: no
	// record is read or written, and without Parent every checkpoint is a
	// base.
	Records *ParentRecords
	// MaxChain is how many deltas a chain may hold (DefaultMaxChain if 0):
	// past it, the checkpoint is a fresh base.
	MaxChain int
	// OpenRAMFile opens the VM's RAM file, the mem-path QEMU reports, for
	// reading (default os.Open). The agent opens it within the VM's
	// container, never by a host path QEMU names.
	OpenRAMFile func(memPath string) (*os.File, error)
}

// Link is what the images stored beside the state (the disk overlay, the
// rootfs) add to the checkpoint index: their manifests in the state's
// repository, links to those in another, annotations. Its VM state part is
// the state manifest's, set by Checkpoint.
type Link = ociimage.CheckpointIndex

// Durations of a checkpoint's phases.
type Durations struct {
	Prepare time.Duration // QMP queries and migration settings
	Stream  time.Duration // migration into the store
	Stopped time.Duration // WhileStopped hook
	Push    time.Duration // config and manifest
	Total   time.Duration
	Save    time.Duration // mapped-ram: QEMU writing the staging file; memory-file: scanning the RAM file, the VM stopped (part of Stream)
	Precopy time.Duration // memory-file, snapshot mode: the pre-copy of the RAM file's pages, the VM running until its final pass
}

// CheckpointResult is what a checkpoint produced.
type CheckpointResult struct {
	Manifest ocispec.Descriptor // the VM state manifest
	Image    ociimage.Reference // the VM state manifest, pinned by digest
	// Checkpoint is the checkpoint index, listing the state manifest and
	// the images stored beside it (its digest names the checkpoint), and
	// CheckpointImage that index, pinned.
	Checkpoint      ocispec.Descriptor
	CheckpointImage ociimage.Reference
	Config          Config
	Stream          chunk.StreamResult
	// Downtime is how long the guest did not run: QEMU's figure in live
	// mode, stop to continue in snapshot mode, stop to stored in pause mode
	// (where the guest stays stopped).
	Downtime  time.Duration
	Durations Durations
	VMRunning bool // the source's state when Checkpoint returned
	// RAMParentNote says, for a memory-file base, why it has no parent.
	RAMParentNote string
	// RAMParentTrust is, for a memory-file delta, how far its parent's
	// page map was trusted: ParentRecorded or ParentVerified.
	// RAMRefutedPages is how many pages a verified parent vouched for
	// that the VM's memory did not hold (stored: a forged or corrupt
	// parent). RAMRecordNote says why the checkpoint was not recorded as
	// the VM's next parent, if it was not.
	RAMParentTrust  string
	RAMRefutedPages int
	RAMRecordNote   string
	// RAMCapture is how a memory-file checkpoint read the RAM file:
	// CapturePrecopy or CaptureScan; RAMCaptureNote why it scanned when a
	// pre-copy was tried.
	RAMCapture, RAMCaptureNote string
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
		opts.Mode = ModeSnapshot
	}
	// Not a cross-flag rule (internal/snapshot's CheckpointSpec.Validate
	// refuses live mode with a disk or rootfs image, before this is
	// reached): WhileStopped is defined to run while the VM is stopped,
	// which live mode never does, so vmstate's public API refuses the pair
	// on its own.
	if opts.Mode == ModeLive && opts.WhileStopped != nil {
		return nil, errcode.New(errcode.Usage, "live mode does not stop the VM, so a disk overlay captured beside it would not match memory: use snapshot or pause mode to capture the disk")
	}
	opts.Stream = opts.Stream.WithDefaults()
	res = &CheckpointResult{}

	st, err := queryStatus(ctx, mon)
	if err != nil {
		return nil, err
	}
	switch st.Status {
	case "inmigrate":
		return nil, errcode.New(errcode.InvalidInput, "this QEMU is waiting for an incoming migration: there is no VM state to checkpoint yet")
	case "postmigrate", "finish-migrate":
		// QEMU refuses to migrate a VM a migration has already stopped.
		return nil, errcode.New(errcode.InvalidInput, "this VM was stopped by an earlier pause-mode checkpoint (QEMU state %s) and QEMU will not migrate it again: restore that snapshot into a new QEMU, or continue this VM first (QMP cont)", st.Status)
	}
	wasRunning := st.Running
	// Background snapshot would start a paused VM when it ends; a paused VM
	// needs no background snapshot anyway.
	background := opts.Mode == ModeLive && wasRunning

	record, err := ReadRecord(ctx, mon)
	if err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "reading the VM's compatibility record")
	}
	opts.Stream.ChunkSize = chunkSizeFor(record.MemoryBytes, opts.Stream.ChunkSize)
	res.Config = Config{Record: record, Mode: opts.Mode, Created: time.Now().UTC(), Compression: "zstd", ChunkSize: opts.Stream.ChunkSize}
	format, err := chooseFormat(ctx, mon, opts, record)
	if err != nil {
		return nil, err
	}
	switch format {
	case FormatMappedRAM:
		return checkpointMappedRAM(ctx, mon, repo, opts, st, res, start)
	case FormatMemoryFile:
		return checkpointMemoryFile(ctx, mon, repo, opts, st, res, start)
	}

	stoppedMemory := int64(0) // the VM will not run during the migration
	if opts.Mode != ModeLive || !wasRunning {
		stoppedMemory = record.MemoryBytes
	}
	g, err := guardSource(ctx, mon, wasRunning, migrationSettings{source: true, background: background, stoppedMemory: stoppedMemory})
	defer g.finish(&res, &err)
	if err != nil {
		return nil, err
	}

	sub := mon.Subscribe()
	defer sub.Close()
	save, closeStream, err := streamSaver(ctx, mon, g, sub, repo, opts, res)
	defer closeStream()
	if err != nil {
		return res, err
	}
	err = stopAndSave(ctx, mon, g, repo, opts, res, start, save, nil)
	return res, err
}

// streamSaver readies a checkpoint's migration into a pipe that the chunk
// codec reads: save runs the migration and stores the stream's chunks into
// res.Stream (the whole state for the stream format, the device state for
// the memory-file format). Defer closeStream, even with an error.
func streamSaver(ctx context.Context, mon Monitor, g *sourceGuard, sub *qmp.Subscription, repo ociimage.Repository, opts CheckpointOptions, res *CheckpointResult) (save func(context.Context) error, closeStream func(), err error) {
	pipe, err := openOutgoingPipe(ctx, mon)
	if err != nil {
		return nil, func() {}, err
	}
	record := res.Config.Record
	save = func(ctx context.Context) error {
		streamStart := time.Now()
		var stream chunk.StreamResult
		g.phase = "streaming the VM state"
		info, err := pipe.migrate(ctx, mon, g, sub, func(ctx context.Context, r io.Reader) (err error) {
			stream, err = chunk.EncodeStream(ctx, newBoundedStream(r, record.MemoryBytes), repo, opts.Stream)
			return err
		})
		if err != nil {
			return err
		}
		if opts.Mode == ModeLive && info.Downtime != nil {
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
	return save, func() { pipe.close(mon, g) }, nil
}

// stopAndSave is a checkpoint's one sequence, for both formats, once the
// source is guarded and the format's capture is ready: stop the VM (live
// mode keeps it running), have QEMU save its state (save), run the
// WhileStopped hook, continue the VM in snapshot mode, finish storing the
// state (store, if set: mapped-ram chunks its file once the VM runs again),
// and store the state manifest, the checkpoint's commit point.
func stopAndSave(ctx context.Context, mon Monitor, g *sourceGuard, repo ociimage.Repository, opts CheckpointOptions, res *CheckpointResult, start time.Time, save, store func(context.Context) error) error {
	res.Durations.Prepare = time.Since(start)
	stoppedAt := g.stoppedAt
	if opts.Mode != ModeLive && g.wasRunning && stoppedAt.IsZero() {
		g.phase = "stopping the VM"
		if err := mon.Execute(ctx, "stop", nil, nil); err != nil {
			return errcode.Ensure(errcode.QMPError, err, "stopping the VM")
		}
		stoppedAt = time.Now()
	}
	if err := save(ctx); err != nil {
		return err
	}

	var link Link
	if opts.WhileStopped != nil {
		g.phase = "capturing the disk"
		hookStart := time.Now()
		var err error
		if link, err = opts.WhileStopped(ctx); err != nil {
			return err
		}
		res.Durations.Stopped = time.Since(hookStart)
	}
	if opts.Mode == ModeSnapshot && g.wasRunning {
		if err := mon.Execute(ctx, "cont", nil, nil); err != nil {
			return errcode.Ensure(errcode.QMPError, err, "continuing the VM after the snapshot")
		}
		res.Downtime = time.Since(stoppedAt)
	}
	if store != nil {
		if err := store(ctx); err != nil {
			return err
		}
	}

	g.phase = "storing the manifest and moving the tags"
	if err := pushStateManifest(ctx, repo, opts, res, link); err != nil {
		return err
	}
	if opts.Mode == ModePause && g.wasRunning {
		res.Downtime = time.Since(stoppedAt)
	}
	res.Durations.Total = time.Since(start)
	if st, serr := queryStatus(ctx, mon); serr == nil {
		res.VMRunning = st.Running
	}
	return nil
}

// sourceGuard keeps a checkpoint's promise to the source VM, on either path
// (the stream here, mapped-ram in mappedram.go): a VM is never left stopped
// by a failed checkpoint. Whatever happens, the migration settings are put
// back; on failure, a migration that may still run is cancelled, a VM that
// was running runs again, and the error says so. Its one deferred call,
// finish, does all of it.
type sourceGuard struct {
	ctx        context.Context
	mon        Monitor
	wasRunning bool
	settings   func(context.Context) // puts the migration settings back
	prepared   bool                  // the settings were made: the checkpoint began
	// migrating is set before a migration is asked for (if the reply is
	// lost, it may still run), and cleared once it is over.
	migrating bool
	phase     string // what the checkpoint is doing, for an interruption
	// stoppedAt, if set, is when QEMU itself stopped the VM (a pre-copy's
	// final pass): stopAndSave does not stop it again.
	stoppedAt time.Time
	cleanups  []func() // onFinish
}

// guardSource makes the source's migration settings (prepareMigration)
// under a guard, returned even with an error: defer its finish at once.
func guardSource(ctx context.Context, mon Monitor, wasRunning bool, set migrationSettings) (*sourceGuard, error) {
	g := &sourceGuard{ctx: ctx, mon: mon, wasRunning: wasRunning, phase: "preparing"}
	var err error
	g.settings, err = prepareMigration(ctx, mon, set)
	g.prepared = err == nil
	return g, err
}

// cleanupCtx gives a cleanup step its own budget, even once the caller's
// context has been cancelled.
func (g *sourceGuard) cleanupCtx(d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(g.ctx), d)
}

// onFinish adds f to what finish runs, success or failure, last added first:
// freeing what the migration used (the mapped-ram staging file). On failure
// it runs once the migration is cancelled and the VM continued.
func (g *sourceGuard) onFinish(f func()) { g.cleanups = append(g.cleanups, f) }

// finish is the checkpoint's deferred call, given its results: on failure
// it cancels the migration, continues the VM if it was running, runs the
// onFinish functions, adds to *err what became of the VM and clears *res;
// in any case it puts the migration settings back, last. A panic under the
// guard is such a failure (INTERNAL): the checkpoint returns it as its
// error, and the VM runs again.
func (g *sourceGuard) finish(res **CheckpointResult, err *error) {
	if v := recover(); v != nil {
		*err = errcode.Recovered(v)
	}
	defer func() {
		cctx, cancel := g.cleanupCtx(cleanupTimeout)
		defer cancel()
		g.settings(cctx)
	}()
	if !g.prepared {
		return // nothing was changed, the VM not stopped
	}
	failed := *err != nil
	// Each step gets its own budget: a migration stuck cancelling must not
	// use up the time to continue the VM.
	if failed && g.migrating {
		cctx, cancel := g.cleanupCtx(5 * time.Second)
		cancelMigration(cctx, g.mon)
		cancel()
		g.migrating = false
	}
	state := ""
	if failed && g.wasRunning {
		cctx, cancel := g.cleanupCtx(cleanupTimeout)
		if cerr := ensureRunning(cctx, g.mon); cerr != nil {
			state = fmt.Sprintf("; the VM could not be continued: %v", cerr)
		} else {
			state = "; the VM was continued"
		}
		cancel()
	}
	for i := len(g.cleanups) - 1; i >= 0; i-- {
		g.cleanups[i]()
	}
	if !failed {
		return
	}
	if g.ctx.Err() != nil && errcode.Of(*err) == errcode.Internal {
		*err = errcode.Wrap(errcode.Internal, *err, "the checkpoint was interrupted while %s (%v)%s", g.phase, context.Cause(g.ctx), state)
	} else if state != "" {
		*err = fmt.Errorf("%w%s", *err, state)
	}
	*res = nil
}

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
	undoParams := map[string]any{}
	undo := func(ctx context.Context) {
		// Best effort: these only matter to whoever migrates this QEMU next.
		if len(undoParams) > 0 {
			_ = mon.Execute(ctx, "migrate-set-parameters", undoParams, nil)
		}
		if len(undoCaps) > 0 {
			_ = mon.Execute(ctx, "migrate-set-capabilities", map[string]any{"capabilities": undoCaps}, nil)
		}
	}
	var caps []struct {
		Capability string `json:"capability"`
		State      bool   `json:"state"`
	}
	if err := mon.Execute(ctx, "query-migrate-capabilities", nil, &caps); err != nil {
		return undo, errcode.Ensure(errcode.QMPError, err, "query-migrate-capabilities")
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
			return undo, errcode.Ensure(errcode.QMPError, err, "setting the migration capabilities")
		}
		undoCaps = revert
	}
	if !set.source {
		return undo, nil
	}
	var params struct {
		MaxBandwidth    *int64 `json:"max-bandwidth"`
		DowntimeLimit   *int64 `json:"downtime-limit"`
		MultifdChannels *int64 `json:"multifd-channels"`
	}
	if err := mon.Execute(ctx, "query-migrate-parameters", nil, &params); err != nil {
		return undo, errcode.Ensure(errcode.QMPError, err, "query-migrate-parameters")
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
	if len(want) > 0 {
		if err := mon.Execute(ctx, "migrate-set-parameters", want, nil); err != nil {
			return undo, errcode.Ensure(errcode.QMPError, err, "setting the migration parameters")
		}
		if _, ok := want["max-bandwidth"]; ok {
			undoParams["max-bandwidth"] = *params.MaxBandwidth
		}
		if _, ok := want["downtime-limit"]; ok {
			undoParams["downtime-limit"] = *params.DowntimeLimit
		}
		if _, ok := want["multifd-channels"]; ok {
			undoParams["multifd-channels"] = *params.MultifdChannels
		}
	}
	return undo, nil
}

// maxStreamChunks keeps a manifest well under ociimage.MaxManifestSize
// (a chunk's descriptor takes about 250 bytes).
const maxStreamChunks = 8192

// chunkSizeFor picks a chunk size so that a stream about the size of the
// VM's memory fits in maxStreamChunks chunks.
func chunkSizeFor(memory int64, size int) int {
	size = chunk.EffectiveChunkSize(size)
	for memory/int64(size) >= maxStreamChunks && size < chunk.MaxChunkSize {
		size *= 2
	}
	return size
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

// ensureRunning continues the VM unless it already runs. A migration that
// completed just as the checkpoint failed must be finalized first: QEMU
// refuses cont until then.
func ensureRunning(ctx context.Context, mon Monitor) error {
	st, err := queryStatus(ctx, mon)
	if err != nil {
		return err
	}
	if st.Running {
		return nil
	}
	if st.Status == "finish-migrate" {
		if err := waitFinalized(ctx, mon); err != nil {
			return err
		}
	}
	return errcode.Ensure(errcode.QMPError, mon.Execute(ctx, "cont", nil, nil), "cont")
}
