package vmstate

import (
	"context"
	"io"
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
	if res.Config.Format == FormatMappedRAM {
		return restoreMappedRAM(ctx, mon, repo, m.Layers, opts, res, start)
	}
	// A memory-file image's RAM is the file the target maps (Prepare):
	// only the device state goes through the stream.
	stream, _, err := res.Config.checkRAM(m.Layers)
	if err != nil {
		return nil, err
	}
	if _, err := prepareMigration(ctx, mon, migrationSettings{ignoreShared: res.Config.Format == FormatMemoryFile}); err != nil {
		// A target is discarded on failure: its settings need no undo.
		return nil, err
	}
	sub := mon.Subscribe()
	defer sub.Close()
	res.Durations.Prepare = time.Since(start)

	streamStart := time.Now()
	r, w, err := os.Pipe()
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "creating the migration pipe")
	}
	defer w.Close()
	growPipe(w)
	in := &lazyIncoming{w: w, start: func() error {
		name, err := passFile(ctx, mon, r)
		r.Close() // QEMU holds its own copy now
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
	res.RawBytes, err = chunk.DecodeStream(ctx, stream, repo, in, opts.Stream)
	unblock()
	w.Close() // end of stream for QEMU: it loads what it has and finishes or fails
	if !in.started {
		r.Close()
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
			return nil, errcode.Wrap(errcode.Of(err), err, "the restore stopped part-way, so the waiting QEMU was told to quit: start a new one to try again")
		}
		return nil, err
	}
	if _, err := waitMigration(ctx, mon, sub, nil); err != nil {
		return nil, err
	}
	res.Durations.Stream = time.Since(streamStart)
	return finishRestore(ctx, mon, opts, res, start)
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

// finishRestore sets a loaded VM's run state (continued, or stopped if
// opts.Paused) and completes res: the end of either restore path.
func finishRestore(ctx context.Context, mon Monitor, opts RestoreOptions, res *RestoreResult, start time.Time) (*RestoreResult, error) {
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
	res.Durations.Total = time.Since(start)
	return res, nil
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
