package vmstate

import (
	"context"
	"os"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
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
	run := &checkpointRun{mon: mon, repo: repo, opts: opts, st: st, res: res, start: start}
	switch format {
	case FormatMappedRAM:
		return run.checkpointMappedRAM(ctx)
	case FormatMemoryFile:
		return run.checkpointMemoryFile(ctx)
	}
	return run.checkpointStream(ctx)
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
