package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/qmp"
	"github.com/vmsnap/vmsnap/rootfs"
	"github.com/vmsnap/vmsnap/vmstate"
	"github.com/vmsnap/vmsnap/vmstate/chunk"
)

// The operations below are what a checkpoint or a restore is, whoever asks:
// the CLI runs them in its own process, the agent's daemon runs them for
// requests on its socket. The VM's files come opened (Handles): the daemon's
// resolver opens a pod's files beneath their volumes; the CLI's own paths
// are opened once here. Paths are names for messages and annotations only.

// Progress reports bytes done in a phase ("vmstate", "disk", "rootfs",
// "restore", "stage"). It may be nil.
type Progress func(phase string, bytes int64)

// bytes is the progress callback of one phase, or nil.
func (p Progress) bytes(phase string) func(int64) {
	if p == nil {
		return nil
	}
	return func(n int64) { p(phase, n) }
}

func (p Progress) stream(phase string, o chunk.StreamOptions) chunk.StreamOptions {
	o.Progress = p.bytes(phase)
	return o
}

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
	// BeforeStop, if set, runs once everything has been checked and just
	// before the VM is touched, with whether the VM runs now (the agent
	// journals there).
	BeforeStop func(ctx context.Context, running bool) error
	// Keep, if above 0, prunes the state image's repository once the
	// checkpoint is committed, keeping the Keep newest (prune.go).
	Keep int
}

// Validate checks a spec without touching anything.
func (s CheckpointSpec) Validate() error {
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
	if s.Keep < 0 {
		return errcode.New(errcode.Usage, "keep %d: give the number of checkpoints to keep, or 0 to prune nothing", s.Keep)
	}
	_, err := vmstate.ParseMode(string(s.Mode))
	return err
}

// checkDiskPlace refuses a disk overlay that no image would hold: one
// without a disk image that is not in the writable layer the rootfs image
// captures. This is known only once the disk is resolved (DiskInRootfs):
// the agent checks it then, Checkpoint again.
func (s CheckpointSpec) checkDiskPlace() error {
	if s.DiskPath != "" && s.DiskImage == "" && !(s.DiskInRootfs && s.RootfsImage != "") {
		return errcode.New(errcode.Usage,
			"the disk overlay %s is on a volume, not in the container's writable layer, so the rootfs image does not hold it: give it an image reference of its own (--disk-image)", s.diskName())
	}
	return nil
}

func (s CheckpointSpec) diskName() string {
	if s.DiskRootfsPath != "" {
		return s.DiskRootfsPath
	}
	return s.DiskPath
}

// openStore parses a reference to write to, opens it and checks that we may
// write there, so that credentials or a CA problem surface before a VM is
// stopped. The repository is opened without the reference's tag, which the
// store keeps: every manifest of a checkpoint is stored by digest, and the
// tags move only once all of them are stored (moveTags).
func openStore(ctx context.Context, s string, opts []ociimage.Option) (*store, error) {
	ref, err := ociimage.ParseReference(s)
	if err != nil {
		return nil, err
	}
	if ref.IsDigest() {
		return nil, errcode.New(errcode.InvalidInput,
			"cannot store a checkpoint at %s: a digest reference names an existing manifest; give REF or REF:TAG", s)
	}
	tag := ref.Tag
	ref.Tag = ""
	repo, err := ociimage.Open(ctx, ref, opts...)
	if err != nil {
		return nil, err
	}
	if err := ociimage.CheckAccess(ctx, repo); err != nil {
		return nil, err
	}
	return &store{repo, tag, opts}, nil
}

// store is where one image of a checkpoint goes: a repository opened
// without its tag, the tag to move once everything is stored, and the
// options the repository was opened with.
type store struct {
	repo ociimage.Repository
	tag  string
	opts []ociimage.Option
}

// tagged is the store's reference with its tag.
func (st *store) tagged() ociimage.Reference {
	ref := st.repo.Reference()
	ref.Tag = st.tag
	return ref
}

// commit points the store's tag at desc.
func (st *store) commit(ctx context.Context, desc ocispec.Descriptor) error {
	if err := ociimage.TagManifest(ctx, st.repo, desc, st.tag); err != nil {
		return errcode.Ensure(errcode.RegistryError, err, "tagging %s as %s", st.repo.Reference().WithDigest(desc.Digest), st.tag)
	}
	return nil
}

// current resolves the manifest the store's tag names now.
func (st *store) current(ctx context.Context) (ocispec.Descriptor, error) {
	repo, err := ociimage.Open(ctx, st.tagged(), st.opts...)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	return repo.Resolve(ctx)
}

// tagMove is one tag of a checkpoint to move: its store's tag to the
// manifest to. what names the image in errors.
type tagMove struct {
	what string // "disk", "rootfs" or "VM state"
	st   *store
	to   ocispec.Descriptor

	prev    ocispec.Descriptor // where the tag pointed before, if prevErr is nil
	prevErr error
}

// rollbackTimeout bounds moving tags back after a failure, which may be the
// caller's deadline.
const rollbackTimeout = 30 * time.Second

// moveTags moves the tags of one checkpoint's images in order, the VM
// state's last: it is the checkpoint's commit point. Moves without a store
// or a tag are skipped. Before any tag moves it resolves where the others
// point now, so that when a later move fails it can move those already
// moved back. That is best effort: a tag that named nothing before (or
// whose target could not be resolved, or that cannot be moved back) stays on
// its new manifest, as ociimage cannot delete a tag. The error keeps the
// failed move's code and lists, as details, what was moved back and what
// was not.
func moveTags(ctx context.Context, moves ...tagMove) error {
	moves = slices.DeleteFunc(moves, func(m tagMove) bool { return m.st == nil || m.st.tag == "" })
	for i := range moves[:max(len(moves)-1, 0)] {
		moves[i].prev, moves[i].prevErr = moves[i].st.current(ctx)
	}
	for i, m := range moves {
		if err := m.st.commit(ctx, m.to); err != nil {
			return rollbackTags(ctx, moves[:i], m, err)
		}
	}
	return nil
}

// rollbackTags, once the move failed has failed with err, moves back the
// tags moved before it, the last first, and returns err with what it did.
func rollbackTags(ctx context.Context, moved []tagMove, failed tagMove, err error) error {
	if len(moved) == 0 {
		return err
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	var details []string
	for _, m := range slices.Backward(moved) {
		name := fmt.Sprintf("the %s tag %s", m.what, m.st.tagged())
		if m.prevErr != nil {
			details = append(details, fmt.Sprintf("%s is left on the new manifest %s: it named no manifest before, or none that could be resolved (%v), and vmsnap cannot delete a tag", name, m.to.Digest, m.prevErr))
			continue
		}
		if rerr := m.st.commit(ctx, m.prev); rerr != nil {
			details = append(details, fmt.Sprintf("%s is left on the new manifest %s: moving it back to %s failed (%v)", name, m.to.Digest, m.prev.Digest, rerr))
			continue
		}
		details = append(details, fmt.Sprintf("%s was moved back to %s", name, m.prev.Digest))
	}
	return &errcode.Error{Code: errcode.Of(err), Err: err, Details: details,
		Msg: fmt.Sprintf("the checkpoint is not committed: its images are stored by digest, but the %s tag did not move", failed.what)}
}

// Checkpoint captures a VM (its disk overlay, and its container's writable
// layer) into images. Every image is stored by digest first; only once all
// of them are stored do their tags move, the VM state's last: it is the
// checkpoint's commit point, and a failure before it leaves every tag where
// it was: a disk or rootfs tag that had already moved is moved back, as far
// as the store allows (moveTags says when it cannot be).
func Checkpoint(ctx context.Context, s CheckpointSpec) (*api.CheckpointResult, error) {
	if s.Mode == "" {
		s.Mode = vmstate.ModeSnapshot
	}
	if err := s.Validate(); err != nil {
		return nil, err
	}
	if err := s.checkDiskPlace(); err != nil {
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
		if s.CaptureRootfs == nil {
			return nil, errcode.New(errcode.Usage, "capturing the container's writable layer needs the node agent, which finds the container through containerd: checkpoint through --agent")
		}
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
		if _, _, err := rootfs.InspectOverlay(h.Disk, s.DiskPath); err != nil {
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

	opts := vmstate.CheckpointOptions{Mode: s.Mode, Stream: s.Progress.stream("vmstate", s.Stream), Format: s.Format, StagingDir: s.StagingDir}
	opts.Annotations = previous
	var (
		disk       *rootfs.CaptureResult
		layer      *rootfs.LayerResult
		overlay    rootfs.Header // of an overlay captured in the rootfs image only
		overlaySz  int64
		overlayDur time.Duration
	)
	if diskStore != nil || rootfsStore != nil {
		opts.WhileStopped = func(ctx context.Context) (vmstate.Link, error) {
			link := vmstate.Link{Annotations: map[string]string{}}
			var err error
			if diskStore != nil {
				beforeDiskCapture()
				disk, err = rootfs.Capture(ctx, h.Disk, s.DiskPath, diskStore.repo, s.Progress.stream("disk", s.Stream))
				if err != nil {
					return vmstate.Link{}, err
				}
				link.Annotations[ociimage.AnnotationDiskImage] = disk.Image.String()
				link.Subject = &disk.Manifest
			}
			if rootfsStore != nil {
				if diskInRootfs && disk == nil {
					// What the rootfs image will hold, as it is now.
					t0 := time.Now()
					if overlay, overlaySz, err = rootfs.InspectOverlay(h.Disk, s.DiskPath); err != nil {
						return vmstate.Link{}, err
					}
					overlayDur = time.Since(t0)
				}
				if layer, err = s.CaptureRootfs(ctx, rootfsStore.repo, s.Progress.bytes("rootfs")); err != nil {
					return vmstate.Link{}, err
				}
				link.Annotations[ociimage.AnnotationRootfsImage] = layer.Image.String()
				if diskInRootfs {
					link.Annotations[ociimage.AnnotationDiskRootfsPath] = s.DiskRootfsPath
				}
			}
			return link, nil
		}
	}
	opts.Commit = func(ctx context.Context, desc ocispec.Descriptor) error {
		var moves []tagMove
		if disk != nil {
			moves = append(moves, tagMove{what: "disk", st: diskStore, to: disk.Manifest})
		}
		if layer != nil {
			moves = append(moves, tagMove{what: "rootfs", st: rootfsStore, to: layer.Manifest})
		}
		return moveTags(ctx, append(moves, tagMove{what: "VM state", st: state, to: desc})...)
	}
	res, err := vmstate.Checkpoint(ctx, mon, state.repo, opts)
	if err != nil {
		return nil, err
	}
	out := &api.CheckpointResult{
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
			DurationsMs: map[string]float64{
				"prepare": api.Ms(res.Durations.Prepare), "stream": api.Ms(res.Durations.Stream),
				"disk": api.Ms(res.Durations.Stopped), "push": api.Ms(res.Durations.Push), "total": api.Ms(res.Durations.Total),
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
			Path: s.DiskPath, RawBytes: overlaySz, VirtualSize: overlay.VirtualSize, BackingFile: overlay.BackingFile,
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
		out.Pruned = pruneAfterCheckpoint(ctx, s.Image, s.Keep, s.Store)
	}
	return out, nil
}

// beforeDiskCapture runs while the VM is stopped, just before its disk
// overlay is read: when a hostile QEMU knows its migration stream has ended.
// Tests swap the overlay's path there.
var beforeDiskCapture = func() {}

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

// openPinned opens a reference for restore: by digest only, unless allowTag.
func openPinned(ctx context.Context, s, what string, allowTag bool, opts []ociimage.Option) (ociimage.Repository, error) {
	ref, err := ociimage.ParseReference(s)
	if err != nil {
		return nil, err
	}
	if !ref.IsDigest() && !allowTag {
		return nil, errcode.New(errcode.TagNotAllowed,
			"%s %s names a tag, which can move: give the digest that checkpoint printed (REF@sha256:...), or allow tags explicitly (--allow-tag)", what, s)
	}
	return ociimage.Open(ctx, ref, opts...)
}

// RestoreSpec is a restore of VM state into a QEMU waiting with -incoming defer.
type RestoreSpec struct {
	QMPPath string // names the QMP socket, as CheckpointSpec's
	// QMP is the socket opened by whoever resolved it (an O_PATH
	// descriptor, the agent's); without it, QMPPath is opened as the
	// caller's own path. The caller keeps ownership.
	QMP      *os.File
	Image    string // REF@sha256:...
	AllowTag bool
	Paused   bool
	Stream   chunk.StreamOptions
	Store    []ociimage.Option
	Progress Progress
	// StagingDir is where a mapped-ram image is staged (default $TMPDIR).
	StagingDir string
}

// RestoreState loads a VM state image into a waiting QEMU.
func RestoreState(ctx context.Context, s RestoreSpec) (*api.RestoreResult, error) {
	if s.QMPPath == "" || s.Image == "" {
		return nil, errcode.New(errcode.Usage, "restoring VM state needs a QMP socket and an image reference")
	}
	repo, err := openPinned(ctx, s.Image, "image", s.AllowTag, s.Store)
	if err != nil {
		return nil, err
	}
	q := s.QMP
	if q == nil {
		h, err := OpenLocal(s.QMPPath, "")
		if err != nil {
			return nil, err
		}
		defer h.Close()
		q = h.QMP
	}
	mon, err := qmp.DialFile(ctx, q, s.QMPPath)
	if err != nil {
		return nil, err
	}
	defer mon.Close()
	res, err := vmstate.Restore(ctx, mon, repo, vmstate.RestoreOptions{Paused: s.Paused, Stream: s.Progress.stream("restore", s.Stream), StagingDir: s.StagingDir})
	if err != nil {
		return nil, err
	}
	return &api.RestoreResult{VMState: &api.RestoredState{
		Image: repo.Reference().WithDigest(res.Manifest.Digest).String(), Digest: res.Manifest.Digest.String(),
		RawBytes: res.RawBytes, VMRunning: res.VMRunning,
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
	repo, err := openPinned(ctx, s.Image, "disk image", s.AllowTag, s.Store)
	if err != nil {
		return nil, err
	}
	res, err := rootfs.Restore(ctx, repo, s.Path, s.Progress.stream("disk", s.Stream))
	if err != nil {
		return nil, err
	}
	return &api.RestoredDisk{
		Image: repo.Reference().WithDigest(res.Manifest.Digest).String(), Digest: res.Manifest.Digest.String(),
		Path: s.Path, Bytes: res.Bytes, DurationsMs: map[string]float64{"total": api.Ms(res.Duration)},
	}, nil
}

// StagedTag names the VM state image Stage puts in a directory, for
// StreamStaged (vmsnap stream --dir) to find.
const StagedTag = "vmstate"

// StageSpec pulls and verifies a VM state image into a directory (an init
// container's job), refusing an image larger than MaxBytes.
type StageSpec struct {
	Image    string // REF@sha256:...
	Dir      string
	AllowTag bool
	MaxBytes int64
	Jobs     int
	Store    []ociimage.Option
}

// Stage copies a VM state image into Dir as an OCI layout, every blob
// verified, its config and chunk list checked as a restore would.
func Stage(ctx context.Context, s StageSpec) (*api.StagedState, error) {
	if s.Image == "" || s.Dir == "" {
		return nil, errcode.New(errcode.Usage, "staging needs an image reference and a directory")
	}
	src, err := openPinned(ctx, s.Image, "image", s.AllowTag, s.Store)
	if err != nil {
		return nil, err
	}
	// Check the image before copying a byte of its chunks.
	desc, m, _, err := vmstate.LoadConfig(ctx, src)
	if err != nil {
		return nil, err
	}
	dir, err := filepath.Abs(s.Dir)
	if err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "staging directory %s", s.Dir)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "creating the staging directory")
	}
	dst, err := ociimage.Open(ctx, ociimage.Reference{Layout: dir, Tag: StagedTag})
	if err != nil {
		return nil, err
	}
	pinned, err := ociimage.Open(ctx, src.Reference().WithDigest(desc.Digest), s.Store...)
	if err != nil {
		return nil, err
	}
	if _, err := ociimage.Copy(ctx, pinned, dst, s.MaxBytes, max(s.Jobs, 4)); err != nil {
		return nil, err
	}
	return &api.StagedState{Image: pinned.Reference().String(), Digest: desc.Digest.String(), Dir: dir, Bytes: sizeOf(m)}, nil
}

func sizeOf(m ocispec.Manifest) int64 {
	n := m.Config.Size
	for _, l := range m.Layers {
		n += l.Size
	}
	return n
}

// StagedDigest is the digest of the VM state image Stage put in dir: what
// a launcher marks as loaded.
func StagedDigest(ctx context.Context, dir string) (digest.Digest, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", errcode.Wrap(errcode.Usage, err, "--state-dir %s", dir)
	}
	repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: abs, Tag: StagedTag})
	var desc ocispec.Descriptor
	if err == nil {
		desc, err = repo.Resolve(ctx)
	}
	if err != nil {
		return "", errcode.Wrap(errcode.InvalidInput, err, "no VM state staged in %s (did the restore init container run with --to-dir %s?)", dir, dir)
	}
	return desc.Digest, nil
}

// StreamStaged writes the raw VM state staged in dir to w, verifying every
// chunk again (the volume may have been tampered with since).
func StreamStaged(ctx context.Context, dir string, w interface{ Write([]byte) (int, error) }, o chunk.StreamOptions) error {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return errcode.Wrap(errcode.Usage, err, "--dir %s", dir)
	}
	repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: abs, Tag: StagedTag})
	if err != nil {
		return err
	}
	_, m, cfg, err := vmstate.LoadConfig(ctx, repo)
	if err != nil {
		return err
	}
	if cfg.Format == vmstate.FormatMappedRAM {
		return errcode.New(errcode.CompatMismatch,
			"the staged image is in the mapped-ram format, which QEMU loads from a file, not from a stream: restore it with vmsnap restore --qmp into a QEMU 9.0 or later waiting with -incoming defer")
	}
	_, err = chunk.DecodeStream(ctx, m.Layers, repo, w, o)
	return err
}
