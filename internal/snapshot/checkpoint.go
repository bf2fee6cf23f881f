package snapshot

import (
	"context"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/hook"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp"
	"github.com/vmsnap/vmsnap/rootfs"
	"github.com/vmsnap/vmsnap/vmstate"
	vmdisk "github.com/vmsnap/vmsnap/vmstate/disk"
)

// CheckpointSpec is one checkpoint of the VM behind a QMP socket.
type CheckpointSpec struct {
	// QMPPath and DiskPath name the QMP socket and the qcow2 overlay to
	// capture while the VM is stopped (optional), as the caller gave them:
	// inside the container, through the agent. DiskPath goes into the disk
	// image's annotations.
	QMPPath  string
	DiskPath string
	// Handles are those files, opened and checked by whoever resolved them
	// (the agent's resolver); Checkpoint uses nothing else. Without them,
	// Checkpoint opens QMPPath and DiskPath as the caller's own paths
	// (OpenLocal), once. The caller keeps ownership: Checkpoint does not
	// close them.
	Handles *Handles
	Image   string // where the state goes: oci:DIR[:TAG] or HOST/REPO[:TAG]
	// DiskImage is where the overlay goes as an image of its own. It may be
	// left out when the overlay rides in the rootfs image (DiskInRootfs
	// with RootfsImage); given anyway, the overlay is stored there as well.
	DiskImage string
	// DiskInRootfs says that DiskPath is in the QEMU container's writable
	// layer, not on a volume (the agent's resolver knows which), and
	// DiskRootfsPath is its path inside the container. With RootfsImage, the
	// overlay is then captured as part of the rootfs image, at that path,
	// and not a second time.
	DiskInRootfs   bool
	DiskRootfsPath string
	// RootfsImage, with CaptureRootfs, is where the QEMU container's
	// writable layer goes, as a container image. CaptureRootfs stores it
	// there; the agent sets it from its resolver (it knows the container),
	// and in pause and snapshot modes it runs while the VM is stopped.
	RootfsImage   string
	CaptureRootfs func(ctx context.Context, repo ociimage.Repository, progress func(layerBytes int64)) (*rootfs.LayerResult, error)
	Mode          vmstate.Mode
	Stream        chunk.StreamOptions
	Store         []ociimage.Option
	Progress      Progress
	// Format and StagingDir: vmstate.CheckpointOptions's (auto and $TMPDIR
	// when left empty).
	Format     vmstate.Format
	StagingDir string
	// StagingOwner: vmstate.CheckpointOptions's (the agent: the VM's
	// namespace).
	StagingOwner string
	// Parent, for the memory-file format, is the checkpoint
	// (REF@sha256:..., in the same repository as Image) this one stores
	// the changed pages of, verified against the VM's memory unless
	// Records holds it; empty: the one Records holds for the VM, if it can
	// be. MaxChain bounds a chain's deltas (vmstate.DefaultMaxChain if 0).
	Parent   string
	MaxChain int
	// Records is where the node keeps the VM's last memory-file
	// checkpoint, the parent of its next (vmstate.ParentRecords). Nil: no
	// record, and without Parent every such checkpoint is a base.
	Records *vmstate.ParentRecords
	// BeforeStop, if set, runs once everything has been checked and just
	// before the VM is touched, with whether the VM runs now (the agent
	// journals there).
	BeforeStop func(ctx context.Context, running bool) error
	// Keep, if above 0, prunes the state image's repository once the
	// checkpoint is committed, keeping the Keep newest (prune.go).
	Keep int
}

// Validate applies the spec's defaults (snapshot mode) and checks it,
// without touching anything: the one place a checkpoint request is
// checked, by Checkpoint and, before it resolves the VM, by the agent.
func (s *CheckpointSpec) Validate() error {
	if s.Mode == "" {
		s.Mode = vmstate.ModeSnapshot
	}
	if s.QMPPath == "" || s.Image == "" {
		return errcode.New(errcode.Usage, "a checkpoint needs a QMP socket and an image reference")
	}
	if s.DiskImage != "" && s.DiskPath == "" {
		return errcode.New(errcode.Usage, "a disk image reference needs the disk overlay's path")
	}
	if s.DiskPath != "" && s.DiskImage == "" && s.RootfsImage == "" {
		return errcode.New(errcode.Usage, "the disk overlay and its image reference go together (the reference may be left out only for an overlay in the container's writable layer captured with the rootfs image)")
	}
	if s.DiskInRootfs && s.DiskRootfsPath == "" {
		return errcode.New(errcode.Usage, "a disk overlay in the container's writable layer needs its path inside the container")
	}
	if s.RootfsImage != "" && s.Mode == vmstate.ModeLive {
		return errcode.New(errcode.Usage, "live mode keeps the VM running, so the container's writable layer would not match the captured memory: use mode snapshot or pause to capture it")
	}
	if s.Mode == vmstate.ModeLive && s.DiskPath != "" {
		return errcode.New(errcode.Usage, "live mode keeps the VM running, so its disk would not match the captured memory: use mode snapshot or pause to capture the disk")
	}
	if s.MaxChain < 0 || s.MaxChain > vmstate.MaxChain {
		return errcode.New(errcode.Usage, "maxChain %d: give how many deltas a chain may hold, up to %d, or 0 for the default (%d)", s.MaxChain, vmstate.MaxChain, vmstate.DefaultMaxChain)
	}
	if s.Keep < 0 {
		return errcode.New(errcode.Usage, "keep %d: give the number of checkpoints to keep, or 0 to prune nothing", s.Keep)
	}
	_, err := vmstate.ParseMode(string(s.Mode))
	return err
}

// CheckDiskPlace refuses a disk overlay that no image would hold: one
// without a disk image that is not in the writable layer the rootfs image
// captures. This is known only once the disk is resolved (DiskInRootfs):
// the agent checks it then, Checkpoint again.
func (s CheckpointSpec) CheckDiskPlace() error {
	if s.DiskPath != "" && s.DiskImage == "" && !(s.DiskInRootfs && s.RootfsImage != "") {
		return errcode.New(errcode.Usage,
			"the disk overlay %s is on a volume, not in the container's writable layer, so the rootfs image does not hold it: give it an image reference of its own (%s)", s.diskName(), errcode.Field("diskImage"))
	}
	return nil
}

func (s CheckpointSpec) diskName() string {
	if s.DiskRootfsPath != "" {
		return s.DiskRootfsPath
	}
	return s.DiskPath
}

// Checkpoint captures a VM (its disk overlay, and its container's writable
// layer) into images. Every image is stored by digest first; only once all
// of them are stored do their tags move, the VM state's last: it is the
// checkpoint's commit point, and a failure before it leaves every tag where
// it was: a disk or rootfs tag that had already moved is moved back, as far
// as the store allows (moveTags says when it cannot be).
func Checkpoint(ctx context.Context, s CheckpointSpec) (*api.CheckpointResult, error) {
	// The one check that the writable layer can be captured at all, first:
	// the CLI relies on it, as the agent gives CaptureRootfs and refuses
	// earlier where it cannot (Validate runs before it does).
	if s.RootfsImage != "" && s.CaptureRootfs == nil {
		return nil, errcode.New(errcode.Usage, "%s captures a container's writable layer through the node's containerd: use it with %s",
			errcode.Field("rootfsImage"), errcode.Field("agent"))
	}
	if err := s.Validate(); err != nil {
		return nil, err
	}
	if err := s.CheckDiskPlace(); err != nil {
		return nil, err
	}
	state, err := openStore(ctx, s.Image, s.Store)
	if err != nil {
		return nil, err
	}
	// Retention's link to the checkpoint this one follows (prune.go).
	previous, err := state.previousLink(ctx)
	if err != nil {
		return nil, err
	}
	var rootfsStore *store
	if s.RootfsImage != "" {
		if rootfsStore, err = openStore(ctx, s.RootfsImage, s.Store); err != nil {
			return nil, err
		}
	}
	var diskStore *store
	if s.DiskImage != "" {
		if diskStore, err = openStore(ctx, s.DiskImage, s.Store); err != nil {
			return nil, err
		}
	}
	// Each image beside the state must be one the checkpoint index can
	// list or link (parts.go): refused before the VM is touched.
	if err := state.canHold("disk", diskStore); err != nil {
		return nil, err
	}
	if err := state.canHold("rootfs", rootfsStore); err != nil {
		return nil, err
	}
	// The overlay rides in the rootfs image when it is in the writable layer
	// that image captures.
	diskInRootfs := s.DiskPath != "" && s.DiskInRootfs && rootfsStore != nil
	h, err := s.handles()
	if err != nil {
		return nil, err
	}
	if s.Handles == nil {
		defer h.Close()
	}
	if h.Disk != nil {
		// Refuse a bad overlay before the VM is touched.
		if _, _, err := vmdisk.Inspect(h.Disk, s.DiskPath); err != nil {
			return nil, err
		}
	}
	mon, err := qmp.DialFile(ctx, h.QMP, s.QMPPath)
	if err != nil {
		return nil, err
	}
	defer mon.Close()
	if s.BeforeStop != nil {
		st, err := mon.Status(ctx)
		if err != nil {
			return nil, err
		}
		if err := s.BeforeStop(ctx, st.Running); err != nil {
			return nil, err
		}
	}

	opts := vmstate.CheckpointOptions{Mode: s.Mode, Stream: s.Progress.stream("vmstate", s.Stream), Format: s.Format, StagingDir: s.StagingDir, StagingOwner: s.StagingOwner,
		MaxChain: s.MaxChain, Records: s.Records, OpenRAMFile: h.OpenRAMFile}
	opts.Annotations = previous
	if s.Parent != "" {
		if opts.Parent, err = state.parent(ctx, s.Parent, s.Store); err != nil {
			return nil, err
		}
	}
	var (
		disk       *vmdisk.CaptureResult
		layer      *rootfs.LayerResult
		ovl        vmdisk.Header // of an overlay captured in the rootfs image only
		overlaySz  int64
		overlayDur time.Duration
	)
	// The images beside the state, each captured while the VM is stopped
	// and linked from the state manifest; their tags move before the
	// state's (parts.go).
	var parts []*part
	if diskStore != nil {
		parts = append(parts, &part{what: "disk", st: diskStore, capture: func(ctx context.Context, link *vmstate.Link) (ocispec.Descriptor, error) {
			hook.BeforeDiskCapture()
			var err error
			if disk, err = vmdisk.Capture(ctx, h.Disk, s.DiskPath, diskStore.repo, s.Progress.stream("disk", s.Stream)); err != nil {
				return ocispec.Descriptor{}, err
			}
			return disk.Manifest, state.join(link, ociimage.PartDisk, diskStore, disk.Manifest)
		}})
	}
	if rootfsStore != nil {
		parts = append(parts, &part{what: "rootfs", st: rootfsStore, capture: func(ctx context.Context, link *vmstate.Link) (ocispec.Descriptor, error) {
			var err error
			if diskInRootfs && disk == nil {
				// What the rootfs image will hold, as it is now.
				t0 := time.Now()
				if ovl, overlaySz, err = vmdisk.Inspect(h.Disk, s.DiskPath); err != nil {
					return ocispec.Descriptor{}, err
				}
				overlayDur = time.Since(t0)
			}
			if layer, err = s.CaptureRootfs(ctx, rootfsStore.repo, s.Progress.bytes("rootfs")); err != nil {
				return ocispec.Descriptor{}, err
			}
			if diskInRootfs {
				link.Annotations[ociimage.AnnotationDiskRootfsPath] = s.DiskRootfsPath
			}
			return layer.Manifest, state.join(link, ociimage.PartRootfs, rootfsStore, layer.Manifest)
		}})
	}
	if len(parts) > 0 {
		opts.WhileStopped = captureParts(parts)
	}
	opts.Commit = commitParts(parts, state)
	res, err := vmstate.Checkpoint(ctx, mon, state.repo, opts)
	if err != nil {
		return nil, err
	}
	out := &api.CheckpointResult{
		Checkpoint: &api.CheckpointRef{Image: res.CheckpointImage.String(), Digest: res.Checkpoint.Digest.String()},
		VMState: api.VMStateResult{
			Image:         res.Image.String(),
			Digest:        res.Manifest.Digest.String(),
			RawBytes:      res.Stream.RawBytes,
			StoredBytes:   res.Stream.StoredBytes,
			UploadedBytes: res.Stream.UploadedBytes,
			Chunks:        len(res.Stream.Layers),
			QEMUVersion:   res.Config.Record.QEMUVersion,
			Machine:       res.Config.Record.Machine,
			MemoryBytes:   res.Config.Record.MemoryBytes,
			Format:        formatName(res.Config.Format),
			RAM:           ramResult(res),
			DurationsMs: map[string]float64{
				"prepare": api.Ms(res.Durations.Prepare), "stream": api.Ms(res.Durations.Stream),
				"disk": api.Ms(res.Durations.Stopped), "push": api.Ms(res.Durations.Push), "total": api.Ms(res.Durations.Total),
				// mapped-ram: QEMU writing its file; memory-file: scanning the
				// RAM file while the VM is stopped (both part of stream).
				"save": api.Ms(res.Durations.Save),
				// memory-file, snapshot mode: the pre-copy, the VM running
				// until its final pass (precopy is before stream).
				"precopy": api.Ms(res.Durations.Precopy),
			},
		},
		Mode:       string(s.Mode),
		DowntimeMs: api.Ms(res.Downtime),
		VMRunning:  res.VMRunning,
		TotalMs:    api.Ms(res.Durations.Total),
	}
	switch {
	case disk != nil:
		out.Disk = &api.DiskResult{
			Image: disk.Image.String(), Digest: disk.Manifest.Digest.String(), Path: s.DiskPath,
			RawBytes: disk.Stream.RawBytes, StoredBytes: disk.Stream.StoredBytes, UploadedBytes: disk.Stream.UploadedBytes,
			Chunks: len(disk.Stream.Layers), VirtualSize: disk.Config.VirtualSize, BackingFile: disk.Config.BackingFile,
			DurationsMs: map[string]float64{"total": api.Ms(disk.Duration)},
		}
	case diskInRootfs:
		out.Disk = &api.DiskResult{
			Path: s.DiskPath, RawBytes: overlaySz, VirtualSize: ovl.VirtualSize, BackingFile: ovl.BackingFile,
			DurationsMs: map[string]float64{"total": api.Ms(overlayDur)},
		}
	}
	if layer != nil {
		out.Rootfs = &api.RootfsResult{
			Image: layer.Image.String(), Digest: layer.Manifest.Digest.String(), ContainerID: layer.ContainerID,
			BaseImage: layer.BaseImage, Layer: layer.Layer.Digest.String(), LayerBytes: layer.Layer.Size, Compression: layer.Compression,
			StoredBytes: layer.StoredBytes, UploadedBytes: layer.UploadedBytes,
			DurationsMs: map[string]float64{"diff": api.Ms(layer.Durations.Diff), "compress": api.Ms(layer.Durations.Compress), "push": api.Ms(layer.Durations.Push), "total": api.Ms(layer.Durations.Total)},
		}
		if diskInRootfs {
			out.Disk.InRootfs = &api.DiskInRootfs{Image: out.Rootfs.Image, Digest: out.Rootfs.Digest, Path: s.DiskRootfsPath}
		}
	}
	if s.Keep > 0 {
		out.Pruned = PruneAfterCheckpoint(ctx, s.Image, s.Keep, s.Store)
	}
	return out, nil
}

// handles returns the spec's Handles, or opens its paths (OpenLocal); the
// caller closes what it opened.
func (s CheckpointSpec) handles() (*Handles, error) {
	if s.Handles == nil {
		return OpenLocal(s.QMPPath, s.DiskPath)
	}
	if s.Handles.QMP == nil || (s.Handles.Disk != nil) != (s.DiskPath != "") {
		return nil, errcode.New(errcode.Internal, "the checkpoint's opened files do not match its QMP socket and disk paths")
	}
	return s.Handles, nil
}

// formatName is a config's format as results print it ("stream" for the
// empty format of a stream).
func formatName(f vmstate.Format) string {
	if f == "" {
		return string(vmstate.FormatStream)
	}
	return string(f)
}

// ramResult describes a memory-file image's RAM file, or nil.
func ramResult(res *vmstate.CheckpointResult) *api.RAMResult {
	r := res.Config.RAM
	if r == nil {
		return nil
	}
	out := &api.RAMResult{Backend: r.Backend, Bytes: r.Bytes, DataBytes: r.DataBytes, Parent: string(r.Parent()), BaseNote: res.RAMParentNote,
		Capture: res.RAMCapture, CaptureNote: res.RAMCaptureNote,
		ParentTrust: res.RAMParentTrust, RefutedPages: res.RAMRefutedPages, RecordNote: res.RAMRecordNote}
	for _, l := range r.Chain {
		out.Chain = append(out.Chain, api.ChainLink{Manifest: string(l.Manifest), Created: l.Created, Regions: l.Regions, StoredBytes: l.StoredBytes, ChangedPages: l.ChangedPages})
	}
	return out
}
