package ociimage

import (
	"context"
	"slices"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Reading a checkpoint back: its index checked as a hostile one would be,
// and the part a reader needs opened from it.

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
			return nil, errcode.New(errcode.InvalidInput, "checkpoint %s lists %s as part %q (%s): not a part vmsnap knows", ref, e.Digest, clip(name), clip(e.MediaType))
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
			return nil, nil, errcode.New(errcode.InvalidInput, "checkpoint %s has no disk image: its disk overlay is in its rootfs image, at %s; start the container from that image", c.Ref, clip(path))
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
