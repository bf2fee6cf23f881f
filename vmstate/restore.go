package vmstate

import (
	"context"
	"os"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// RestoreOptions tunes Restore.
type RestoreOptions struct {
	// Paused leaves the VM stopped once its state is loaded. A QEMU started
	// without -S may run the guest for an instant before it is stopped.
	Paused bool
	Stream chunk.StreamOptions
	// StagingDir is where a mapped-ram image is staged, verified, before
	// QEMU loads it (default $TMPDIR).
	StagingDir string
	// StagingOwner: CheckpointOptions.StagingOwner.
	StagingOwner string
	// Cache is the RAM cache of the restore's caller (the CLI's
	// --cache-dir, the agent's cache of the VM's namespace), where Prepare
	// put memory-file images: an image prepared there from the same
	// repository is read from the device state kept beside its file, and
	// the target must not map that file shared. Nothing else on the node
	// is read for a restore, least of all a path QEMU names.
	Cache *ramfile.Cache
}

// RestoreDurations are a restore's phases.
type RestoreDurations struct {
	Prepare time.Duration // manifest, config, compatibility check
	Stream  time.Duration // fetch, verify, decompress, load
	Total   time.Duration // command start to the VM running
}

// RestoreResult is what a restore did.
type RestoreResult struct {
	Manifest  ocispec.Descriptor
	Config    Config
	RawBytes  int64
	Durations RestoreDurations
	VMRunning bool
	// FromNode: the image was read from the device state Prepare kept
	// beside the RAM file the target maps, not from the store.
	FromNode bool
	// GenerationID is the VM generation ID the guest finds once restored:
	// the target's own, checked to differ from the snapshot's ("": the
	// snapshot's VM has no vmgenid device).
	GenerationID string
}

// LoadConfig fetches and checks a VM state image's manifest and config
// without touching any QEMU.
func LoadConfig(ctx context.Context, repo ociimage.Repository) (ocispec.Descriptor, ocispec.Manifest, Config, error) {
	var cfg Config
	desc, m, err := ociimage.PullArtifact(ctx, repo, ociimage.ArtifactTypeVMState, &cfg)
	if err != nil {
		return desc, m, cfg, err
	}
	if err := cfg.Record.Validate(); err != nil {
		return desc, m, cfg, err
	}
	if err := cfg.checkFormat(); err != nil {
		return desc, m, cfg, err
	}
	if err := cfg.checkSize(); err != nil {
		return desc, m, cfg, err
	}
	stream, _, err := cfg.checkRAM(m.Layers)
	if err != nil {
		return desc, m, cfg, err
	}
	total, err := chunk.ValidateLayers(stream)
	if err != nil {
		return desc, m, cfg, err
	}
	if len(stream) == 0 {
		return desc, m, cfg, errcode.New(errcode.InvalidInput, "the image holds no VM state chunks")
	}
	if total != cfg.RawBytes {
		return desc, m, cfg, errcode.New(errcode.InvalidInput, "the image's chunks add up to %d bytes but its config declares %d", total, cfg.RawBytes)
	}
	return desc, m, cfg, nil
}

// Restore loads a VM state image into the QEMU behind mon, which must be
// waiting with -incoming defer. It refuses a QEMU that does not match the
// recorded VM before a byte is sent, sends only chunks that match their
// digests, and starts the incoming migration only once the first chunk has
// been verified, so that an image that is bad from its start never reaches
// QEMU at all.
func Restore(ctx context.Context, mon Monitor, repo ociimage.Repository, opts RestoreOptions) (*RestoreResult, error) {
	start := time.Now()
	res := &RestoreResult{}
	st, err := queryStatus(ctx, mon)
	if err != nil {
		return nil, err
	}
	if st.Status != "inmigrate" {
		return nil, errcode.New(errcode.InvalidInput, "QEMU is %s, not waiting for an incoming migration: start it with -incoming defer and the same machine options as the source", st.Status)
	}

	target, err := ReadRecord(ctx, mon)
	if err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "reading the waiting QEMU's compatibility record")
	}
	cache := holdCache(opts.Cache)
	defer cache.Close()
	// An image prepared on this node, from this very repository: its
	// device state was kept in the cache, and nothing comes from the store.
	if local := cache.State(repo.Reference().Digest, repo.Reference()); local != nil {
		repo, res.FromNode = local, true
	}
	var m ocispec.Manifest
	res.Manifest, m, res.Config, err = LoadConfig(ctx, repo)
	if err != nil {
		return nil, err
	}
	var prepared *os.File
	if res.Config.RAM != nil {
		prepared = cache.File(res.Manifest.Digest, res.Config.RAM.Bytes)
	}
	if err := checkRestorable(ctx, mon, res.Config, res.Manifest.Digest, target, prepared); err != nil {
		return nil, err
	}
	res.GenerationID = restoredGenerationID(res.Config.Record, target)
	run := &restoreRun{mon: mon, repo: repo, opts: opts, res: res, start: start}
	if res.Config.Format == FormatMappedRAM {
		return run.restoreMappedRAM(ctx, m.Layers)
	}
	return run.restoreStream(ctx, m.Layers)
}

// restoreRun is one restore, as each format's path shares it: the waiting
// QEMU's monitor, the store the image is read from (the node's cache, if
// it has the image), the options, and the result it fills in. Restore
// fills it in once the image and the target are checked, and hands it to
// the format's path (restoreStream, restoreMappedRAM), which ends in
// finish.
type restoreRun struct {
	mon   Monitor
	repo  ociimage.Repository
	opts  RestoreOptions
	res   *RestoreResult
	start time.Time
}

// holdCache opens a restore's cache for lookups. A cache that cannot be
// trusted (another user's, writable by others) is not read at all: the
// image then comes from the store, as if the cache did not have it.
func holdCache(c *ramfile.Cache) *ramfile.Held {
	if c == nil {
		return nil
	}
	h, err := c.Hold()
	if err != nil {
		return nil
	}
	return h
}

// finish sets a loaded VM's run state (continued, or stopped if
// opts.Paused) and completes res: the end of every restore path.
func (r *restoreRun) finish(ctx context.Context) (*RestoreResult, error) {
	mon, opts, res := r.mon, r.opts, r.res
	st, err := queryStatus(ctx, mon)
	if err != nil {
		return nil, err
	}
	switch {
	case opts.Paused && st.Running:
		err = mon.Execute(ctx, "stop", nil, nil)
	case !opts.Paused && !st.Running:
		err = mon.Execute(ctx, "cont", nil, nil)
	}
	if err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "setting the restored VM's run state")
	}
	res.VMRunning = !opts.Paused
	res.Durations.Total = time.Since(r.start)
	return res, nil
}

// FinishIncoming waits until a QEMU that loads a stream by itself (started
// with -incoming "exec:vmsnap stream ...") has loaded it, then sets the run
// state: continued, or stopped if paused is set. QEMU keeps the run state
// recorded in the stream, and a checkpoint stops the VM before capturing
// it, so without this the restored VM would stay paused.
func FinishIncoming(ctx context.Context, mon Executor, paused bool) (running bool, err error) {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		st, err := queryStatus(ctx, mon)
		if err != nil {
			return false, errcode.Wrap(errcode.QMPError, err, "waiting for QEMU to load the state (a QEMU that failed to load exits: see its log)")
		}
		switch st.Status {
		case "inmigrate":
			select {
			case <-tick.C:
				continue
			case <-ctx.Done():
				return false, errcode.Wrap(errcode.QMPError, context.Cause(ctx), "QEMU was still loading the state")
			}
		case "running":
			if paused {
				return false, errcode.Ensure(errcode.QMPError, mon.Execute(ctx, "stop", nil, nil), "stopping the restored VM")
			}
			return true, nil
		case "paused", "postmigrate", "prelaunch":
			if paused {
				return false, nil
			}
			return true, errcode.Ensure(errcode.QMPError, mon.Execute(ctx, "cont", nil, nil), "continuing the restored VM")
		default:
			return false, errcode.New(errcode.QMPError, "QEMU is %s after loading the state: see its log", st.Status)
		}
	}
}
