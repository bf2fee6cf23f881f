package snapshot

import (
	"context"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/hook"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/rootfs"
	"github.com/vmsnap/vmsnap/vmstate"
	vmdisk "github.com/vmsnap/vmsnap/vmstate/disk"
)

// checkAll is every check of the spec that needs nothing opened, with
// Validate's defaults applied.
func (s *CheckpointSpec) checkAll() error {
	// The one check that the writable layer can be captured at all, first:
	// the CLI relies on it, as the agent gives CaptureRootfs and refuses
	// earlier where it cannot (Validate runs before it does).
	if s.RootfsImage != "" && s.CaptureRootfs == nil {
		return errcode.New(errcode.Usage, "%s captures a container's writable layer through the node's containerd: use it with %s",
			errcode.Field("rootfsImage"), errcode.Field("agent"))
	}
	if err := s.Validate(); err != nil {
		return err
	}
	return s.CheckDiskPlace()
}

// checkpointRun is one Checkpoint's state: its stores, its opened files,
// and what the parts captured while the VM was stopped, which the result
// reports.
type checkpointRun struct {
	s                      CheckpointSpec
	h                      *Handles
	state                  *store
	previous               map[string]string // retention's link to the checkpoint this one follows (prune.go)
	diskStore, rootfsStore *store            // nil: no such image
	// diskInRootfs: the overlay rides in the rootfs image, as it is in the
	// writable layer that image captures.
	diskInRootfs bool

	disk       *vmdisk.CaptureResult
	layer      *rootfs.LayerResult
	ovl        vmdisk.Header // of an overlay captured in the rootfs image only
	overlaySz  int64
	overlayDur time.Duration
}

// openCheckpointStores opens the state's store and those of the images
// beside it, and refuses, before the VM is touched, an image the checkpoint
// index could neither list nor link (parts.go).
func openCheckpointStores(ctx context.Context, s CheckpointSpec) (*checkpointRun, error) {
	c := &checkpointRun{s: s}
	var err error
	if c.state, err = openStore(ctx, s.Image, s.Store); err != nil {
		return nil, err
	}
	if c.previous, err = c.state.previousLink(ctx); err != nil {
		return nil, err
	}
	if s.RootfsImage != "" {
		if c.rootfsStore, err = openStore(ctx, s.RootfsImage, s.Store); err != nil {
			return nil, err
		}
	}
	if s.DiskImage != "" {
		if c.diskStore, err = openStore(ctx, s.DiskImage, s.Store); err != nil {
			return nil, err
		}
	}
	if err := c.state.canHold("disk", c.diskStore); err != nil {
		return nil, err
	}
	if err := c.state.canHold("rootfs", c.rootfsStore); err != nil {
		return nil, err
	}
	c.diskInRootfs = s.DiskPath != "" && s.DiskInRootfs && c.rootfsStore != nil
	return c, nil
}

// options are vmstate's checkpoint options: the spec's, the parent, and the
// images beside the state, each captured while the VM is stopped and linked
// from the state manifest; their tags move before the state's (parts.go).
func (c *checkpointRun) options(ctx context.Context) (vmstate.CheckpointOptions, error) {
	s := c.s
	opts := vmstate.CheckpointOptions{Mode: s.Mode, Stream: s.Progress.stream("vmstate", s.Stream), Format: s.Format, StagingDir: s.StagingDir, StagingOwner: s.StagingOwner,
		MaxChain: s.MaxChain, Records: s.Records, OpenRAMFile: c.h.OpenRAMFile}
	opts.Annotations = c.previous
	if s.Parent != "" {
		var err error
		if opts.Parent, err = c.state.parent(ctx, s.Parent, s.Store); err != nil {
			return vmstate.CheckpointOptions{}, err
		}
	}
	var parts []*part
	if c.diskStore != nil {
		parts = append(parts, &part{what: "disk", st: c.diskStore, capture: c.captureDisk})
	}
	if c.rootfsStore != nil {
		parts = append(parts, &part{what: "rootfs", st: c.rootfsStore, capture: c.captureRootfs})
	}
	if len(parts) > 0 {
		opts.WhileStopped = captureParts(parts)
	}
	opts.Commit = commitParts(parts, c.state)
	return opts, nil
}

// captureDisk stores the overlay as an image of its own and joins it to the
// checkpoint index.
func (c *checkpointRun) captureDisk(ctx context.Context, link *vmstate.Link) (ocispec.Descriptor, error) {
	hook.BeforeDiskCapture()
	var err error
	if c.disk, err = vmdisk.Capture(ctx, c.h.Disk, c.s.DiskPath, c.diskStore.repo, c.s.Progress.stream("disk", c.s.Stream)); err != nil {
		return ocispec.Descriptor{}, err
	}
	return c.disk.Manifest, c.state.join(link, ociimage.PartDisk, c.diskStore, c.disk.Manifest)
}

// captureRootfs stores the container's writable layer (with the overlay in
// it, if it is there) and joins it to the checkpoint index.
func (c *checkpointRun) captureRootfs(ctx context.Context, link *vmstate.Link) (ocispec.Descriptor, error) {
	var err error
	if c.diskInRootfs && c.disk == nil {
		// What the rootfs image will hold, as it is now.
		t0 := time.Now()
		if c.ovl, c.overlaySz, err = vmdisk.Inspect(c.h.Disk, c.s.DiskPath); err != nil {
			return ocispec.Descriptor{}, err
		}
		c.overlayDur = time.Since(t0)
	}
	if c.layer, err = c.s.CaptureRootfs(ctx, c.rootfsStore.repo, c.s.Progress.bytes("rootfs")); err != nil {
		return ocispec.Descriptor{}, err
	}
	if c.diskInRootfs {
		link.Annotations[ociimage.AnnotationDiskRootfsPath] = c.s.DiskRootfsPath
	}
	return c.layer.Manifest, c.state.join(link, ociimage.PartRootfs, c.rootfsStore, c.layer.Manifest)
}
