package ociimage

import (
	"path/filepath"
	"slices"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Checkpoints from before the checkpoint index: a tagged VM state manifest
// whose annotations name its disk and rootfs images as REF@DIGEST, with the
// host of the registry it was pushed to (or a layout's path). vmsnap reads
// them, never writes them; their links are resolved where the checkpoint is
// read, never at the host they name.

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

// resolveLegacyLink resolves a link of a checkpoint from before the
// checkpoint index, a full REF@DIGEST, against base the same way: a
// registry's repository path on base's registry (the host it names is
// ignored: a copy elsewhere must not lead back), a layout only if it is
// base's own or one beside it.
func resolveLegacyLink(base Reference, s string) (Reference, error) {
	ref, err := ParseReference(s)
	if err != nil {
		return Reference{}, err
	}
	if !ref.IsDigest() {
		return Reference{}, errcode.New(errcode.InvalidInput, "link %q is not pinned by digest", s)
	}
	switch {
	case base.IsLayout() && ref.IsLayout():
		if SameRepository(base, ref) {
			return base.WithDigest(ref.Digest), nil
		}
		a, erra := filepath.Abs(base.Layout)
		b, errb := filepath.Abs(ref.Layout)
		if erra == nil && errb == nil && filepath.Dir(a) == filepath.Dir(b) {
			return siblingLayout(base, filepath.Base(b), ref.Digest, s)
		}
		return Reference{}, errcode.New(errcode.InvalidInput, "link %q leads to a layout that is neither %s nor beside it: inspect it by its own reference", s, base.Layout)
	case !base.IsLayout() && !ref.IsLayout():
		return Reference{Registry: base.Registry, Repository: ref.Repository, Digest: ref.Digest}, nil
	}
	return Reference{}, errcode.New(errcode.InvalidInput, "link %q leads from %s to another kind of store", s, base.WithDigest(""))
}
