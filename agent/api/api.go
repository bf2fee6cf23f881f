// Package api holds the JSON documents vmsnap exchanges: the results the
// CLI prints with --json, the requests and operations of the node agent's
// HTTP API, and its events. The CLI running locally, the agent, and the
// Job client talking to the agent all produce and read these same types, so
// a controller sees one shape whichever way a checkpoint ran.
//
// It is a light package, for the agent's callers: it links no more than
// errcode and vmstate/vmspec (the names of modes and formats), never
// vmstate itself (what inspect prints, which holds vmstate's config, is
// internal/snapshot's InspectResult).
package api

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

// CheckpointResult is what a checkpoint produced.
type CheckpointResult struct {
	// Checkpoint is the checkpoint index: the one reference that names
	// every image of the checkpoint (docs/image-format.md).
	Checkpoint *CheckpointRef `json:"checkpoint,omitempty"`
	VMState    VMStateResult  `json:"vmstate"`
	Disk       *DiskResult    `json:"disk,omitempty"`
	Rootfs     *RootfsResult  `json:"rootfs,omitempty"`
	Mode       vmspec.Mode    `json:"mode"`
	DowntimeMs float64        `json:"downtimeMs"`
	VMRunning  bool           `json:"vmRunning"`
	TotalMs    float64        `json:"totalMs"`
	// Pruned is what the prune after the checkpoint (CheckpointRequest.Keep)
	// kept and removed.
	Pruned *PruneResult `json:"pruned,omitempty"`
}

// CheckpointRef names a checkpoint by its index: what restore, prepare and
// inspect accept in place of each image's own reference.
type CheckpointRef struct {
	Image  string `json:"image"` // REF@sha256:... of the checkpoint index
	Digest string `json:"digest"`
}

// VMStateResult describes a stored VM state image.
type VMStateResult struct {
	Image         string `json:"image"` // REF@sha256:...
	Digest        string `json:"digest"`
	RawBytes      int64  `json:"rawBytes"`
	StoredBytes   int64  `json:"storedBytes"`
	UploadedBytes int64  `json:"uploadedBytes"`
	Chunks        int    `json:"chunks"`
	QEMUVersion   string `json:"qemuVersion"`
	Machine       string `json:"machine"`
	MemoryBytes   int64  `json:"memoryBytes"`
	// Format is how the image holds the state: stream, mapped-ram or
	// memory-file (then RAM describes the RAM file).
	Format      vmspec.Format      `json:"format"`
	RAM         *RAMResult         `json:"ram,omitempty"`
	DurationsMs map[string]float64 `json:"durationsMs"`
}

// RAMResult describes a memory-file image's RAM file: its size, and the
// chain of checkpoints its layers come from, base first, the image itself
// last (with no manifest digest: it is VMStateResult.Digest).
type RAMResult struct {
	Backend   string      `json:"backend"`
	Bytes     int64       `json:"bytes"`
	DataBytes int64       `json:"dataBytes"` // non-zero pages
	Parent    string      `json:"parent,omitempty"`
	Chain     []ChainLink `json:"chain"`
	// BaseNote says why a base has no parent (no earlier checkpoint under
	// the tag, a chain at its bound, ...).
	BaseNote string `json:"baseNote,omitempty"`
	// Capture is how the RAM file was read: "precopy" (a live migration
	// of its pages, QEMU stopping the VM only for the final pass: snapshot
	// mode) or "scan" (the file read with the VM stopped: pause mode, or
	// when a pre-copy fails, which CaptureNote then explains).
	Capture     string `json:"capture"`
	CaptureNote string `json:"captureNote,omitempty"`
	// ParentTrust is, for a delta, how far its parent was trusted:
	// "recorded" (the checkpoint this node recorded for the VM, its own
	// map of the VM's memory) or "verified" (a parent named otherwise:
	// every page it vouched for checked against the VM's memory).
	// RefutedPages is how many pages a verified parent vouched for that
	// the VM's memory did not hold (stored; a forged or corrupt parent).
	ParentTrust  string `json:"parentTrust,omitempty"`
	RefutedPages int    `json:"refutedPages,omitempty"`
	// RecordNote says why this checkpoint was not recorded as the VM's
	// next parent, if it was not (the next checkpoint is then a base).
	RecordNote string `json:"recordNote,omitempty"`
}

// ChainLink is one checkpoint of a RAM file's chain.
type ChainLink struct {
	Manifest     string    `json:"manifest,omitempty"`
	Created      time.Time `json:"created"`
	Regions      int       `json:"regions"`
	Packs        int       `json:"packs,omitempty"`
	StoredBytes  int64     `json:"storedBytes"`
	ChangedPages int       `json:"changedPages"`
}

// PrepareRequest asks the node agent to ready a memory-file image's RAM
// file in its cache (POST /v1/prepares: an operation, whose result is a
// PrepareResult). The cache is the caller's
// namespace's (STATE_DIR/ram/NAMESPACE): QEMU before 8.2 opens a
// share=off file read-write, so files are shared within one tenant only.
type PrepareRequest struct {
	Image    string `json:"image"` // REF@sha256:... of the VM state image or its checkpoint (index)
	AllowTag bool   `json:"allowTag,omitempty"`
	// Namespace whose cache to use: the caller's by default; an admin
	// (--admin-namespace, or a process on the node) may name any.
	Namespace string `json:"namespace,omitempty"`
	// QEMUDir is the cache directory as the target QEMU sees it (where
	// its container mounts it), for qemuArgs and memoryFile; default the
	// agent's own path of it.
	QEMUDir string `json:"qemuDir,omitempty"`
	Workers int    `json:"workers,omitempty"`
}

// PrepareResult is what `vmsnap prepare` made ready: the RAM file of a
// memory-file image on this node, and what the target QEMU adds to its
// arguments to map it (then -incoming defer, then restore --qmp).
type PrepareResult struct {
	Image  string `json:"image"`
	Digest string `json:"digest"`
	// Checkpoint is the checkpoint index the image was found through,
	// when the reference given named a checkpoint rather than the image.
	Checkpoint   string             `json:"checkpoint,omitempty"`
	QEMUArgs     []string           `json:"qemuArgs"`
	MemoryFile   string             `json:"memoryFile"`
	FetchedBytes int64              `json:"fetchedBytes"` // 0: the cache held it
	MemoryBytes  int64              `json:"memoryBytes"`
	DataBytes    int64              `json:"dataBytes"`
	Evicted      []string           `json:"evicted,omitempty"`
	DurationsMs  map[string]float64 `json:"durationsMs"`
	// RecordNote says, for a VM given its own copy (copyTo), why the node
	// did not record the image as the parent of the VM's next checkpoint
	// (which is then a base).
	RecordNote string `json:"recordNote,omitempty"`
}

// DiskResult describes a captured disk overlay: stored as an image of its
// own (Image, Digest: what `restore --disk-image` takes), or, when it was in
// the QEMU container's writable layer, as part of the rootfs image
// (InRootfs), or both if both were asked for. Without an image of its own,
// Image and Digest are empty and the stored, uploaded and chunk counts 0.
type DiskResult struct {
	Image         string             `json:"image,omitempty"`
	Digest        string             `json:"digest,omitempty"`
	Path          string             `json:"path"` // the overlay's path as given: inside the container, through the agent
	InRootfs      *DiskInRootfs      `json:"inRootfs,omitempty"`
	RawBytes      int64              `json:"rawBytes"` // the overlay file's size
	StoredBytes   int64              `json:"storedBytes"`
	UploadedBytes int64              `json:"uploadedBytes"`
	Chunks        int                `json:"chunks"`
	VirtualSize   uint64             `json:"virtualSize"`
	BackingFile   string             `json:"backingFile,omitempty"`
	DurationsMs   map[string]float64 `json:"durationsMs"`
}

// DiskInRootfs says where a disk overlay that lived in the QEMU container's
// writable layer is in the rootfs image that holds it: a container started
// from that image finds the overlay at Path, as the source container did.
type DiskInRootfs struct {
	Image  string `json:"image"` // the rootfs image, REF@sha256:... (as rootfs.image)
	Digest string `json:"digest"`
	Path   string `json:"path"` // the overlay's path inside the container
}

// RootfsResult describes a stored container image: the QEMU container's
// image plus one layer holding the diff of its writable layer.
type RootfsResult struct {
	Image         string             `json:"image"` // REF@sha256:...
	Digest        string             `json:"digest"`
	ContainerID   string             `json:"containerID"`
	BaseImage     string             `json:"baseImage"`
	Layer         string             `json:"layer"`       // digest of the new layer
	LayerBytes    int64              `json:"layerBytes"`  // its size, compressed
	Compression   string             `json:"compression"` // zstd, or gzip where containerd cannot write zstd (1.6)
	StoredBytes   int64              `json:"storedBytes"`
	UploadedBytes int64              `json:"uploadedBytes"`
	DurationsMs   map[string]float64 `json:"durationsMs"`
}

// RestoreResult is what a restore did: the state loaded into a QEMU, a disk
// overlay put in place, or both staged in a directory.
type RestoreResult struct {
	VMState  *RestoredState `json:"vmstate,omitempty"`
	Disk     *RestoredDisk  `json:"disk,omitempty"`
	Staged   *StagedState   `json:"staged,omitempty"`
	Endpoint *Endpoint      `json:"endpoint,omitempty"`
	// AlreadyRestored is the marker (restore --marker-dir) of an earlier
	// successful run of the same restore in this pod: nothing was done this
	// time, and the rest of the result is that run's.
	AlreadyRestored string `json:"alreadyRestored,omitempty"`
}

// RestoredState describes VM state loaded into a waiting QEMU.
type RestoredState struct {
	Image  string `json:"image"`
	Digest string `json:"digest"`
	// Checkpoint is the checkpoint index the image was found through,
	// when the reference given named a checkpoint rather than the image.
	Checkpoint string `json:"checkpoint,omitempty"`
	RawBytes   int64  `json:"rawBytes"`
	VMRunning  bool   `json:"vmRunning"`
	// FromNode says the state was read from what vmsnap prepare kept on
	// this node beside the RAM file the QEMU maps, not from the registry.
	FromNode bool `json:"fromNode,omitempty"`
	// GenerationID is the VM generation ID the restored guest finds (its
	// vmgenid device's, the target QEMU's own), so that clones diverge.
	GenerationID string             `json:"generationID,omitempty"`
	DurationsMs  map[string]float64 `json:"durationsMs"`
}

// RestoredDisk describes a disk overlay put in place.
type RestoredDisk struct {
	Image  string `json:"image"`
	Digest string `json:"digest"`
	// Checkpoint is the checkpoint index the image was found through,
	// when the reference given named a checkpoint rather than the image.
	Checkpoint  string             `json:"checkpoint,omitempty"`
	Path        string             `json:"path"`
	Bytes       int64              `json:"bytes"`
	DurationsMs map[string]float64 `json:"durationsMs"`
}

// StagedState describes a VM state image pulled and verified into a
// directory, for `vmsnap stream --dir`.
type StagedState struct {
	Image  string `json:"image"`
	Digest string `json:"digest"`
	// Checkpoint is the checkpoint index the image was found through,
	// when the reference given named a checkpoint rather than the image.
	Checkpoint string `json:"checkpoint,omitempty"`
	Dir        string `json:"dir"`
	Bytes      int64  `json:"bytes"`
	// Format is the image's state format; "memory-file": only its device
	// state was staged, its RAM file is prepared apart (vmsnap prepare).
	Format vmspec.Format `json:"format,omitempty"`
}

// Endpoint is where a restored VM now lives. Whoever routes to the VM
// updates from it at once instead of waiting for a watch.
type Endpoint struct {
	PodUID    string `json:"podUID"`
	Container string `json:"container"`
	QMPPath   string `json:"qmp"`
}

// Error is the error object of the CLI's --json output and of the agent's
// failed responses and operations.
type Error struct {
	Code    errcode.Code `json:"code"`
	Message string       `json:"message"`
	Details []string     `json:"details,omitempty"`
}

// ErrorDoc wraps an Error as the CLI prints it: {"error": {...}}.
type ErrorDoc struct {
	Error Error `json:"error"`
}

// ErrorOf converts any error into its JSON form. It never panics: an error
// that cannot be described (an Error method that panics) is INTERNAL, and
// the message says so.
func ErrorOf(err error) (e Error) {
	defer func() {
		if v := recover(); v != nil {
			e = Error{Code: errcode.Internal, Message: "the error could not be described: " + errcode.Recovered(v).Error()}
		}
	}()
	e = Error{Code: errcode.Of(err), Message: err.Error()}
	if d := errcode.DetailsOf(err); len(d) > 0 {
		e.Details = d
		e.Message = errcode.Summary(err)
	}
	return e
}

// Truncated returns the error cut down to fit max bytes of JSON, dropping
// details from the end first (a Kubernetes termination log holds 4096
// bytes, and a cut JSON document is worth nothing to a controller).
func (e Error) Truncated(max int) Error {
	fits := func(e Error) bool {
		b, _ := json.Marshal(ErrorDoc{Error: e})
		return len(b) <= max
	}
	if fits(e) {
		return e
	}
	all := e.Details
	for n := len(all) - 1; n >= 0; n-- {
		e.Details = append(append([]string(nil), all[:n]...), fmt.Sprintf("... and %d more", len(all)-n))
		if fits(e) {
			return e
		}
	}
	e.Details = nil
	for len(e.Message) > 16 && !fits(e) {
		e.Message = e.Message[:len(e.Message)*3/4] + "..."
	}
	return e
}

// Error makes a decoded Error usable as a Go error that keeps its code
// (errcode.Of) and details (errcode.DetailsOf).
func (e *Error) Error() string          { return e.Message }
func (e *Error) ErrorCode() string      { return string(e.Code) }
func (e *Error) ErrorDetails() []string { return e.Details }

// Durations helper: milliseconds with microsecond precision.
func Ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// VMRef names a VM the way a controller knows it: the pod by UID (never by
// name alone: a pod recreated under the same name is another VM), the QEMU
// container by name, and paths as seen inside that container.
type VMRef struct {
	PodUID    string `json:"podUID"`
	Container string `json:"container"`
	QMPPath   string `json:"qmp"`            // QMP socket path inside the container
	DiskPath  string `json:"disk,omitempty"` // qcow2 overlay path inside the container
}

// Target is a VM resolved to this node: the container that runs it and the
// host paths of its QMP socket and disk overlay, for display (the agent
// uses the files its resolver opened, never these paths).
type Target struct {
	PodUID      string `json:"podUID"`
	Container   string `json:"container"`
	ContainerID string `json:"containerID"`
	QMPPath     string `json:"qmpHostPath"`
	DiskPath    string `json:"diskHostPath,omitempty"`
	// DiskInRootfs says the disk overlay is in the container's writable
	// layer (DiskPath is then inside the snapshot containerd keeps that
	// layer in), not on a volume.
	DiskInRootfs bool `json:"diskInRootfs,omitempty"`
	// Namespace is the pod's namespace (its container's
	// io.kubernetes.pod.namespace label): who may act on the VM.
	Namespace string `json:"namespace,omitempty"`
}

// CheckpointRequest asks the agent to checkpoint a VM on its node.
type CheckpointRequest struct {
	VM VMRef `json:"vm"`
	// Image is where the VM state goes, and the checkpoint index that
	// lists the checkpoint's images (its tag names the index).
	Image string `json:"image"`
	// DiskImage, with VM.DiskPath, is where the disk overlay goes as an
	// image of its own: in Image's repository (listed by the index) or
	// another of the same registry (linked). It may be left out when the overlay is in the
	// container's writable layer and RootfsImage is set: the overlay then
	// rides in the rootfs image.
	DiskImage string `json:"diskImage,omitempty"`
	// RootfsImage, if set, is where the QEMU container's writable layer
	// goes, as a container image (its image plus one layer).
	RootfsImage string      `json:"rootfsImage,omitempty"`
	Mode        vmspec.Mode `json:"mode,omitempty"` // pause, snapshot (default) or live
	ChunkSize   int         `json:"chunkSize,omitempty"`
	Workers     int         `json:"workers,omitempty"`
	// Keep, if above 0, prunes the state image's repository once the
	// checkpoint succeeded, keeping the Keep newest checkpoints (as vmsnap
	// prune --keep). 0 takes the agent's --keep default (none: no prune).
	Keep int `json:"keep,omitempty"`
	// Parent and MaxChain, for a VM whose RAM is a shared file (the
	// memory-file format): the checkpoint (REF@sha256:..., in Image's
	// repository) to store the changed pages of, each page it vouches for
	// checked against the VM's memory unless it is the VM's last checkpoint
	// as the agent recorded it, and how many deltas a chain may hold.
	// Empty and 0: the agent's record of the VM's last checkpoint (never
	// what a tag names), and the default bound.
	Parent   string `json:"parent,omitempty"`
	MaxChain int    `json:"maxChain,omitempty"`
}

// RestoreRequest asks the agent to load VM state into a QEMU on its node
// that waits with -incoming defer (the disk overlay is put in place before
// QEMU starts, by the restore init container).
type RestoreRequest struct {
	VM       VMRef  `json:"vm"`
	Image    string `json:"image"` // REF@sha256:... of the VM state image or its checkpoint (index)
	AllowTag bool   `json:"allowTag,omitempty"`
	Paused   bool   `json:"paused,omitempty"`
	Workers  int    `json:"workers,omitempty"`
}

// Operation kinds and states.
const (
	KindCheckpoint = "checkpoint"
	KindRestore    = "restore"
	KindPrepare    = "prepare"

	StatePending   = "pending"   // waiting for a slot on the node
	StateRunning   = "running"   // under way
	StateSucceeded = "succeeded" // Result is set
	StateFailed    = "failed"    // Error is set
	StateCancelled = "cancelled" // cancelled by a caller or because the VM went away; Error says which
)

// Operation is one checkpoint, restore or prepare run by the agent.
type Operation struct {
	ID    string `json:"id"`
	Kind  string `json:"kind"`
	State string `json:"state"`
	// VM and Target are the VM a checkpoint or restore acts on (a
	// prepare acts on none).
	VM     VMRef   `json:"vm"`
	Target *Target `json:"target,omitempty"`
	// Namespace is the namespace the operation acts in (who may see it):
	// its VM's pod's, or the one whose RAM cache a prepare fills.
	Namespace string             `json:"namespace,omitempty"`
	Created   time.Time          `json:"created"`
	Updated   time.Time          `json:"updated"`
	Progress  *OperationProgress `json:"progress,omitempty"`
	// Exactly one of these is set once the operation has ended.
	Checkpoint *CheckpointResult `json:"checkpoint,omitempty"`
	Restore    *RestoreResult    `json:"restore,omitempty"`
	Prepare    *PrepareResult    `json:"prepare,omitempty"`
	Error      *Error            `json:"error,omitempty"`
}

// Done reports whether the operation has ended.
func (o *Operation) Done() bool {
	switch o.State {
	case StateSucceeded, StateFailed, StateCancelled:
		return true
	}
	return false
}

// OperationProgress is how far an operation has come.
type OperationProgress struct {
	Phase string `json:"phase"` // vmstate, disk, restore
	Bytes int64  `json:"bytes"`
}

// Event is one message of the agent's event stream: an operation changed.
// A restore's final event carries the VM's new endpoint in
// Operation.Restore.Endpoint.
type Event struct {
	Type      string    `json:"type"` // "operation"
	Time      time.Time `json:"time"`
	Operation Operation `json:"operation"`
}
