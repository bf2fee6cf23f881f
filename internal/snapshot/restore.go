package snapshot

import (
	"context"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp"
	"github.com/vmsnap/vmsnap/vmstate"
	"github.com/vmsnap/vmsnap/vmstate/disk"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// RestoreSpec is a restore of VM state into a QEMU waiting with -incoming defer.
type RestoreSpec struct {
	QMPPath string // names the QMP socket, as CheckpointSpec's
	// Handles, as CheckpointSpec's: the QMP socket opened by whoever
	// resolved it (the agent's resolver), and no disk (a restore loads
	// the state only). Without them, QMPPath is opened as the caller's own
	// path. The caller keeps ownership.
	Handles  *Handles
	Image    string // REF@sha256:...
	AllowTag bool
	Paused   bool
	Stream   chunk.StreamOptions
	Store    []ociimage.Option
	Progress Progress
	// StagingDir is where a mapped-ram image is staged (default $TMPDIR).
	StagingDir string
	// StagingOwner: vmstate.RestoreOptions's (the agent: the VM's
	// namespace).
	StagingOwner string
	// CacheDir is the RAM cache where the caller prepared memory-file
	// images (PrepareSpec.CacheDir), looked up by the image's digest
	// (vmstate.RestoreOptions.Cache); "" for none. PrivateParent as
	// PrepareSpec's.
	CacheDir      string
	PrivateParent bool
}

// RestoreState loads a VM state image into a waiting QEMU.
func RestoreState(ctx context.Context, s RestoreSpec) (*api.RestoreResult, error) {
	if s.QMPPath == "" || s.Image == "" {
		return nil, errcode.New(errcode.Usage, "restoring VM state needs a QMP socket and an image reference")
	}
	repo, cp, err := openPinned(ctx, s.Image, "image", ociimage.PartVMState, s.AllowTag, s.Store)
	if err != nil {
		return nil, err
	}
	h, done, err := handlesFor("restore", s.Handles, s.QMPPath, "")
	if err != nil {
		return nil, err
	}
	defer done()
	mon, err := qmp.DialFile(ctx, h.QMP, s.QMPPath)
	if err != nil {
		return nil, err
	}
	defer mon.Close()
	opts := vmstate.RestoreOptions{Paused: s.Paused, Stream: s.Progress.stream("restore", s.Stream), StagingDir: s.StagingDir, StagingOwner: s.StagingOwner}
	if s.CacheDir != "" {
		opts.Cache = &ramfile.Cache{Dir: s.CacheDir, PrivateParent: s.PrivateParent}
	}
	res, err := vmstate.Restore(ctx, mon, repo, opts)
	if err != nil {
		return nil, err
	}
	return &api.RestoreResult{VMState: &api.RestoredState{
		Image: repo.Reference().WithDigest(res.Manifest.Digest).String(), Digest: res.Manifest.Digest.String(), Checkpoint: checkpointRef(cp),
		RawBytes: res.RawBytes, VMRunning: res.VMRunning, FromNode: res.FromNode, GenerationID: res.GenerationID,
		DurationsMs: map[string]float64{"prepare": api.Ms(res.Durations.Prepare), "stream": api.Ms(res.Durations.Stream), "total": api.Ms(res.Durations.Total)},
	}}, nil
}

// DiskRestoreSpec puts a disk overlay image in place before QEMU starts.
type DiskRestoreSpec struct {
	Image    string // REF@sha256:...
	Path     string
	AllowTag bool
	Stream   chunk.StreamOptions
	Store    []ociimage.Option
	Progress Progress
}

// RestoreDisk writes a disk overlay image to its path, atomically.
func RestoreDisk(ctx context.Context, s DiskRestoreSpec) (*api.RestoredDisk, error) {
	if s.Image == "" || s.Path == "" {
		return nil, errcode.New(errcode.Usage, "restoring a disk overlay needs an image reference and a path")
	}
	repo, cp, err := openPinned(ctx, s.Image, "disk image", ociimage.PartDisk, s.AllowTag, s.Store)
	if err != nil {
		return nil, err
	}
	res, err := disk.Restore(ctx, repo, s.Path, s.Progress.stream("disk", s.Stream))
	if err != nil {
		return nil, err
	}
	return &api.RestoredDisk{
		Image: repo.Reference().WithDigest(res.Manifest.Digest).String(), Digest: res.Manifest.Digest.String(), Checkpoint: checkpointRef(cp),
		Path: s.Path, Bytes: res.Bytes, DurationsMs: map[string]float64{"total": api.Ms(res.Duration)},
	}, nil
}

// checkpointRef is the checkpoint a result names, "" for none.
func checkpointRef(c *ociimage.Checkpoint) string {
	if c == nil {
		return ""
	}
	return c.Ref.String()
}
