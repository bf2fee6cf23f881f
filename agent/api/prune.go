package api

import "time"

// PruneResult is what a prune kept and removed (vmsnap prune --json, and a
// checkpoint's result when the agent pruned after it).
type PruneResult struct {
	Repository string `json:"repository"` // oci:DIR or HOST/REPO
	Keep       int    `json:"keep"`
	DryRun     bool   `json:"dryRun,omitempty"` // nothing was deleted: Removed is what would go
	// Kept are the checkpoints kept, newest first: the Keep newest, and
	// any whose time is not known (Undated).
	Kept []PrunedCheckpoint `json:"kept"`
	// Removed are the checkpoints deleted, newest first.
	Removed []PrunedCheckpoint `json:"removed"`
	// RemovedImages are the disk and rootfs images of removed checkpoints
	// that were deleted with them: in the same repository, and needed by
	// no kept checkpoint.
	RemovedImages []PrunedImage `json:"removedImages,omitempty"`
	// LeftImages are images of removed checkpoints that were not deleted,
	// each with the reason (a kept checkpoint needs it, or it is in
	// another repository).
	LeftImages []PrunedImage `json:"leftImages,omitempty"`
	// RemovedTags are the tags deleted with their manifests, referrers
	// fallback tags (sha256-HEX) included.
	RemovedTags []string `json:"removedTags,omitempty"`
	// RemovedBlobs counts the blobs an OCI layout no longer needed and
	// deleted (a registry collects its own garbage).
	RemovedBlobs int `json:"removedBlobs,omitempty"`
	// Error, on a checkpoint's result, is why the prune after it failed;
	// the checkpoint itself succeeded.
	Error *Error `json:"error,omitempty"`
}

// PrunedCheckpoint is one checkpoint (a VM state manifest) prune found.
type PrunedCheckpoint struct {
	Digest   string     `json:"digest"`
	Created  *time.Time `json:"created,omitempty"`
	Undated  bool       `json:"undated,omitempty"` // no valid created annotation: always kept
	Tags     []string   `json:"tags,omitempty"`
	Previous string     `json:"previous,omitempty"` // the checkpoint before it under its tag
	Images   []string   `json:"images,omitempty"`   // its disk and rootfs images, REF@DIGEST
}

// PrunedImage is a disk or rootfs image of a removed checkpoint.
type PrunedImage struct {
	Image  string   `json:"image"` // REF@DIGEST
	Tags   []string `json:"tags,omitempty"`
	Reason string   `json:"reason,omitempty"` // why it was left
}
