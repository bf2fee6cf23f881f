package snapshot

import (
	"context"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp"
	"github.com/vmsnap/vmsnap/rootfs"
	"github.com/vmsnap/vmsnap/vmstate"
	vmdisk "github.com/vmsnap/vmsnap/vmstate/disk"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
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
	Mode          vmspec.Mode
	Stream        chunk.StreamOptions
	Store         []ociimage.Option
	Progress      Progress
	// Format and StagingDir: vmstate.CheckpointOptions's (auto and $TMPDIR
	// when left empty).
	Format     vmspec.Format
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
		s.Mode = vmspec.ModeSnapshot
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
	if s.RootfsImage != "" && s.Mode == vmspec.ModeLive {
		return errcode.New(errcode.Usage, "live mode keeps the VM running, so the container's writable layer would not match the captured memory: use mode snapshot or pause to capture it")
	}
	if s.Mode == vmspec.ModeLive && s.DiskPath != "" {
		return errcode.New(errcode.Usage, "live mode keeps the VM running, so its disk would not match the captured memory: use mode snapshot or pause to capture the disk")
	}
	if s.MaxChain < 0 || s.MaxChain > vmstate.MaxChain {
		return errcode.New(errcode.Usage, "maxChain %d: give how many deltas a chain may hold, up to %d, or 0 for the default (%d)", s.MaxChain, vmstate.MaxChain, vmstate.DefaultMaxChain)
	}
	if s.Keep < 0 {
		return errcode.New(errcode.Usage, "keep %d: give the number of checkpoints to keep, or 0 to prune nothing", s.Keep)
	}
	_, err := vmspec.ParseMode(string(s.Mode))
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
	if err := s.checkAll(); err != nil {
		return nil, err
	}
	c, err := openCheckpointStores(ctx, s)
	if err != nil {
		return nil, err
	}
	h, done, err := handlesFor("checkpoint", s.Handles, s.QMPPath, s.DiskPath)
	if err != nil {
		return nil, err
	}
	defer done()
	c.h = h
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
	opts, err := c.options(ctx)
	if err != nil {
		return nil, err
	}
	res, err := vmstate.Checkpoint(ctx, mon, c.state.repo, opts)
	if err != nil {
		return nil, err
	}
	out := c.result(res)
	if s.Keep > 0 {
		out.Pruned = PruneAfterCheckpoint(ctx, s.Image, s.Keep, s.Store)
	}
	return out, nil
}

// formatName is a config's format as results print it ("stream" for the
// empty format of a stream).
func formatName(f vmspec.Format) vmspec.Format {
	if f == "" {
		return vmspec.FormatStream
	}
	return f
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
		out.Chain = append(out.Chain, api.ChainLink{Manifest: string(l.Manifest), Created: l.Created, Regions: l.Regions, Packs: l.Packs, StoredBytes: l.StoredBytes, ChangedPages: l.ChangedPages})
	}
	return out
}
