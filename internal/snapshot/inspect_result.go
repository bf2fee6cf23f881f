package snapshot

import (
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/vmstate"
	"github.com/vmsnap/vmsnap/vmstate/disk"
)

// InspectResult is what vmsnap inspect prints: one image, and for a VM
// state image the images of its checkpoint. It is here, not in agent/api
// with the other results, because it holds the image's config as vmstate
// and disk define it: api stays a light package for the agent's callers.
type InspectResult struct {
	Image        string            `json:"image"`
	Digest       string            `json:"digest"`
	ArtifactType string            `json:"artifactType"`
	Chunks       int               `json:"chunks"`
	StoredBytes  int64             `json:"storedBytes"`
	Annotations  map[string]string `json:"annotations,omitempty"`
	// EncryptedFor lists the key IDs an encrypted image's layers are
	// encrypted for (docs/encryption-and-signing.md); empty for a plaintext image.
	EncryptedFor []string `json:"encryptedFor,omitempty"`
	// Layers are the image's layers by kind ("chunk": a stream's,
	// "ram-pagemap" and "ram-region": a memory-file image's RAM file),
	// with their stored sizes.
	Layers  []LayerKind      `json:"layers,omitempty"`
	VMState *vmstate.Config  `json:"vmstate,omitempty"`
	Disk    *disk.DiskConfig `json:"disk,omitempty"`
	// Checkpoint lists, for a VM state image, the images of its checkpoint
	// together.
	Checkpoint *CheckpointImages `json:"checkpoint,omitempty"`
	LinkedDisk *InspectResult    `json:"linkedDisk,omitempty"`
	// LinkedRootfs is the QEMU container's writable layer, captured with
	// the VM (an ordinary container image).
	LinkedRootfs *RootfsLink `json:"linkedRootfs,omitempty"`
	// Referrers are the VM state images whose subject is this disk image.
	Referrers []Referrer `json:"referrers,omitempty"`
}

// CheckpointImages is what one checkpoint stored, each image pinned.
type CheckpointImages struct {
	// Image and Digest name the checkpoint index, when the checkpoint has
	// one (not before vmsnap wrote indexes).
	Image   string `json:"image,omitempty"`
	Digest  string `json:"digest,omitempty"`
	VMState string `json:"vmstate"`
	Disk    string `json:"disk,omitempty"` // the disk overlay's own image
	// DiskInRootfs is where the disk overlay is in the rootfs image, when
	// it lived in the QEMU container's writable layer.
	DiskInRootfs *api.DiskInRootfs `json:"diskInRootfs,omitempty"`
	Rootfs       string            `json:"rootfs,omitempty"`
}

// RootfsLink is a checkpoint's rootfs image, described by its manifest.
type RootfsLink struct {
	Image      string `json:"image"`
	Digest     string `json:"digest"`
	Layers     int    `json:"layers"`
	Bytes      int64  `json:"bytes"`
	BaseImage  string `json:"baseImage,omitempty"` // the container's image it was captured on
	Layer      string `json:"layer"`               // the captured writable layer (the last one)
	LayerBytes int64  `json:"layerBytes"`          // its size, compressed
}

// Referrer is a VM state image whose subject is the inspected disk image.
type Referrer struct {
	Image        string            `json:"image"`
	Digest       string            `json:"digest"`
	ArtifactType string            `json:"artifactType"`
	Annotations  map[string]string `json:"annotations,omitempty"`
}

// LayerKind is how many layers of one kind an image has, and their bytes.
type LayerKind struct {
	Kind    string `json:"kind"`
	Count   int    `json:"count"`
	Bytes   int64  `json:"bytes"`
	Largest int64  `json:"largest"`
}
