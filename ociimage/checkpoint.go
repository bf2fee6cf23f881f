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

// A checkpoint is stored as one image index (README "Image layout"): in the
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

// ReadCheckpoint reads the checkpoint whose index desc names in repo (an
// image index), or the legacy checkpoint a VM state manifest is. Anything
// else, and an index that is not a well-formed checkpoint index, is
// INVALID_INPUT.
func ReadCheckpoint(ctx context.Context, repo Repository, desc ocispec.Descriptor) (*Checkpoint, error) {
	ref := repo.Reference().WithDigest(desc.Digest)
	if desc.MediaType != ocispec.MediaTypeImageIndex {
		m, err := repo.Manifest(ctx, desc)
		if err != nil {
			return nil, err
		}
		return legacyCheckpoint(ref, desc, m)
	}
	idx, err := repo.Index(ctx, desc)
	if err != nil {
		return nil, err
	}
	if !IsCheckpointIndex(idx) {
		return nil, notCheckpoint{errcode.New(errcode.InvalidInput, "%s is an image index, but not a vmsnap checkpoint (no %s annotation)", ref, AnnotationCheckpoint)}
	}
	c := &Checkpoint{Ref: ref, Annotations: idx.Annotations}
	if len(idx.Manifests) > MaxCheckpointParts {
		return nil, errcode.New(errcode.InvalidInput, "checkpoint %s lists %d images, more than a checkpoint has", ref, len(idx.Manifests))
	}
	for _, e := range idx.Manifests {
		name := e.Annotations[AnnotationPart]
		if !slices.Contains(Parts, name) || e.MediaType != ocispec.MediaTypeImageManifest {
			return nil, errcode.New(errcode.InvalidInput, "checkpoint %s lists %s as part %q (%s): not a part vmsnap knows", ref, e.Digest, name, e.MediaType)
		}
		d := ocispec.Descriptor{MediaType: e.MediaType, Digest: e.Digest, Size: e.Size}
		if err := c.add(Part{Name: name, Ref: repo.Reference().WithDigest(e.Digest), Desc: d}); err != nil {
			return nil, err
		}
	}
	for _, name := range []string{PartDisk, PartRootfs} {
		link := idx.Annotations[linkKeys[name]]
		if link == "" {
			continue
		}
		to, err := ResolveLink(repo.Reference(), link)
		if err != nil {
			return nil, errcode.Wrap(errcode.InvalidInput, err, "checkpoint %s: its %s link", ref, name)
		}
		if err := c.add(Part{Name: name, Ref: to, Linked: true}); err != nil {
			return nil, err
		}
	}
	if _, ok := c.Part(PartVMState); !ok {
		return nil, errcode.New(errcode.InvalidInput, "checkpoint %s lists no VM state image", ref)
	}
	return c, nil
}

// add adds p, refusing a part named twice.
func (c *Checkpoint) add(p Part) error {
	if _, dup := c.Part(p.Name); dup {
		return errcode.New(errcode.InvalidInput, "checkpoint %s has two %s parts", c.Ref, p.Name)
	}
	c.Parts = append(c.Parts, p)
	return nil
}

// legacyCheckpoint is the checkpoint a VM state manifest from before the
// checkpoint index is: the manifest, and its disk and rootfs links
// (AnnotationDiskImage, AnnotationRootfsImage) resolved against ref's
// repository (resolveLegacyLink). A link that does not resolve is left out.
func legacyCheckpoint(ref Reference, desc ocispec.Descriptor, m ocispec.Manifest) (*Checkpoint, error) {
	if m.ArtifactType != ArtifactTypeVMState {
		return nil, notCheckpoint{errcode.New(errcode.InvalidInput, "%s is a %s, not a checkpoint", ref, describeArtifact(m.ArtifactType, m.Config.MediaType))}
	}
	c := &Checkpoint{Ref: ref, Legacy: true, Annotations: m.Annotations,
		Parts: []Part{{Name: PartVMState, Ref: ref, Desc: desc}}}
	if m.Subject != nil {
		c.Subject = m.Subject.Digest
	}
	for name, key := range map[string]string{PartDisk: AnnotationDiskImage, PartRootfs: AnnotationRootfsImage} {
		to, err := resolveLegacyLink(ref, m.Annotations[key])
		if err != nil {
			continue
		}
		c.Parts = append(c.Parts, Part{Name: name, Ref: to, Linked: !SameRepository(ref, to)})
	}
	slices.SortFunc(c.Parts, func(a, b Part) int { return slices.Index(Parts, a.Name) - slices.Index(Parts, b.Name) })
	return c, nil
}

// OpenPart opens the part name of the checkpoint ref names, pinned to its
// manifest: ref may name a checkpoint index (by digest, or by a tag the
// caller allowed), or the part's own manifest, which is then returned as
// it is (a reader checks its artifact type). A linked part (in another
// repository of the same registry) is opened with the same options. The
// checkpoint is returned too (nil when ref named a manifest).
func OpenPart(ctx context.Context, ref Reference, name string, opts ...Option) (Repository, *Checkpoint, error) {
	repo, err := Open(ctx, ref, opts...)
	if err != nil {
		return nil, nil, err
	}
	desc, err := repo.Resolve(ctx)
	if err != nil {
		return nil, nil, err
	}
	if desc.MediaType != ocispec.MediaTypeImageIndex {
		return Pinned(repo, desc), nil, nil
	}
	c, err := ReadCheckpoint(ctx, repo, desc)
	if err != nil {
		return nil, nil, err
	}
	p, ok := c.Part(name)
	if !ok {
		if path := c.Annotations[AnnotationDiskRootfsPath]; name == PartDisk && path != "" {
			return nil, nil, errcode.New(errcode.InvalidInput, "checkpoint %s has no disk image: its disk overlay is in its rootfs image, at %s; start the container from that image", c.Ref, path)
		}
		return nil, nil, errcode.New(errcode.InvalidInput, "checkpoint %s has no %s image", c.Ref, name)
	}
	part, err := c.Open(ctx, repo, p, opts...)
	return part, c, err
}

// Open opens part p of c, which was read from repo, pinned to its
// manifest: from repo when c lists it, else from the repository its link
// names (opened with opts).
func (c *Checkpoint) Open(ctx context.Context, repo Repository, p Part, opts ...Option) (Repository, error) {
	if p.Desc.Digest != "" {
		return Pinned(repo, p.Desc), nil
	}
	other, err := Open(ctx, p.Ref, opts...)
	if err != nil {
		return nil, err
	}
	desc, err := other.Resolve(ctx)
	if err != nil {
		return nil, errcode.Wrap(errcode.Of(err), err, "the %s image %s that checkpoint %s links", p.Name, p.Ref, c.Ref)
	}
	return Pinned(other, desc), nil
}

// StateManifest is the VM state manifest of the checkpoint whose index
// desc names in repo, or desc itself when it names a manifest.
func StateManifest(ctx context.Context, repo Repository, desc ocispec.Descriptor) (ocispec.Descriptor, error) {
	if desc.MediaType != ocispec.MediaTypeImageIndex {
		return desc, nil
	}
	c, err := ReadCheckpoint(ctx, repo, desc)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	p, _ := c.Part(PartVMState) // ReadCheckpoint requires it, in repo
	return p.Desc, nil
}
