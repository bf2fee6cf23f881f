package ociimage

import (
	"context"
	"errors"
	"maps"
	"slices"

	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// A checkpoint is stored as one image index (docs/image-format.md): in the
// repository of its VM state image, listing that image and the disk and
// rootfs images stored in the same repository, each entry marked with its
// part (AnnotationPart); parts in another repository of the same registry
// are links (link.go). The index's digest names the whole checkpoint, so
// that copying that one reference with any OCI tool copies every part.

// CheckpointIndex is what a writer puts in a checkpoint's index.
type CheckpointIndex struct {
	// Parts are the manifests of the checkpoint in the index's repository,
	// by part (PartVMState, PartDisk, PartRootfs), stored already.
	Parts map[string]ocispec.Descriptor
	// Links are the parts in another repository, by part: RelativeLink's.
	Links map[string]string
	// Annotations go on the index (AnnotationCreated, AnnotationPrevious,
	// AnnotationDiskRootfsPath).
	Annotations map[string]string
}

// linkKeys are the annotations that carry a part's link, by part.
var linkKeys = map[string]string{PartDisk: AnnotationDiskLink, PartRootfs: AnnotationRootfsLink}

// PutCheckpoint stores c as a checkpoint index in repo, by digest (the
// caller tags it), and returns its descriptor. The VM state part is
// required; entries are in the order of Parts.
func PutCheckpoint(ctx context.Context, repo Repository, c CheckpointIndex) (ocispec.Descriptor, error) {
	if _, ok := c.Parts[PartVMState]; !ok {
		return ocispec.Descriptor{}, errcode.New(errcode.Internal, "a checkpoint index needs its VM state part")
	}
	annotations := map[string]string{AnnotationCheckpoint: ArtifactTypeCheckpoint}
	maps.Copy(annotations, c.Annotations)
	idx := ocispec.Index{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageIndex, Annotations: annotations}
	for _, part := range Parts {
		d, inRepo := c.Parts[part]
		link, linked := c.Links[part]
		switch {
		case inRepo && linked:
			return ocispec.Descriptor{}, errcode.New(errcode.Internal, "the %s part is both in the checkpoint's repository and linked", part)
		case inRepo:
			// Only what every copy tool keeps: no artifactType, no platform.
			idx.Manifests = append(idx.Manifests, ocispec.Descriptor{MediaType: d.MediaType, Digest: d.Digest, Size: d.Size,
				Annotations: map[string]string{AnnotationPart: part}})
		case linked:
			if _, err := ResolveLink(repo.Reference(), link); err != nil {
				return ocispec.Descriptor{}, errcode.Wrap(errcode.Internal, err, "the %s part's link", part)
			}
			annotations[linkKeys[part]] = link
		}
	}
	return repo.PutIndex(ctx, idx)
}

// ErrNotCheckpoint is in the chain of ReadCheckpoint's error for an image
// that is no checkpoint at all (errors.Is), as opposed to a checkpoint that
// cannot be read.
var ErrNotCheckpoint = errors.New("not a checkpoint")

type notCheckpoint struct{ err error }

func (n notCheckpoint) Error() string        { return n.err.Error() }
func (n notCheckpoint) Unwrap() error        { return n.err }
func (n notCheckpoint) Is(target error) bool { return target == ErrNotCheckpoint }

// Part is one image of a checkpoint as a reader finds it.
type Part struct {
	Name string    // PartVMState, PartDisk or PartRootfs
	Ref  Reference // pinned by digest
	// Desc is the manifest's descriptor as the checkpoint lists it, for a
	// part in the checkpoint's repository; zero for a linked one.
	Desc ocispec.Descriptor
	// Linked says the part is in another repository (Ref's), named by a
	// link: whoever follows it decides whether it may read there.
	Linked bool
}

// Checkpoint is one checkpoint read back: from its index, or a VM state
// manifest from before the index (Legacy), whose links are annotations.
type Checkpoint struct {
	Ref         Reference // the index (or the legacy state manifest), pinned
	Legacy      bool
	Parts       []Part
	Annotations map[string]string // the index's (a legacy state manifest's)
	// Subject is a legacy state manifest's subject: its disk manifest.
	Subject digest.Digest
}

// Part returns the checkpoint's part name, if it has it.
func (c *Checkpoint) Part(name string) (Part, bool) {
	i := slices.IndexFunc(c.Parts, func(p Part) bool { return p.Name == name })
	if i < 0 {
		return Part{}, false
	}
	return c.Parts[i], true
}

// IsCheckpointIndex says whether idx is a checkpoint index.
func IsCheckpointIndex(idx ocispec.Index) bool {
	return idx.Annotations[AnnotationCheckpoint] == ArtifactTypeCheckpoint
}
