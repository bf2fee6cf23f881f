package snapshot

import (
	"context"
	"slices"
	"strings"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
	"github.com/vmsnap/vmsnap/vmstate"
	"github.com/vmsnap/vmsnap/vmstate/disk"
)

// InspectSpec is one inspect of an image.
type InspectSpec struct {
	Image string // REF, REF:TAG or REF@sha256:...
	Store []ociimage.Option
}

// Inspect describes a vmsnap image, every byte read verified. For a
// checkpoint (its index, or a VM state image from before indexes) it
// describes the VM state image and follows the checkpoint's parts: the disk
// image (also described) and the rootfs image. For a disk image it lists
// the VM state images whose subject it is (before indexes). Nothing is
// restored.
func Inspect(ctx context.Context, s InspectSpec) (*InspectResult, error) {
	ref, err := ociimage.ParseReference(s.Image)
	if err != nil {
		return nil, err
	}
	repo, err := ociimage.Open(ctx, ref, s.Store...)
	if err != nil {
		return nil, err
	}
	desc, err := repo.Resolve(ctx)
	if err != nil {
		return nil, err
	}
	if desc.MediaType == ocispec.MediaTypeImageIndex {
		c, err := ociimage.ReadCheckpoint(ctx, repo, desc)
		if err != nil {
			return nil, err
		}
		p, _ := c.Part(ociimage.PartVMState)
		doc, _, err := describe(ctx, ociimage.Pinned(repo, p.Desc), s.Store)
		if err != nil {
			return nil, err
		}
		return doc, followParts(ctx, doc, repo, c, s.Store)
	}
	doc, m, err := describe(ctx, ociimage.Pinned(repo, desc), s.Store)
	if err != nil || m.ArtifactType != ociimage.ArtifactTypeVMState {
		return doc, err
	}
	c, err := ociimage.ReadCheckpoint(ctx, repo, desc)
	if err != nil {
		return nil, err
	}
	return doc, followParts(ctx, doc, repo, c, s.Store)
}

// followParts adds to doc, which describes c's VM state image, the images
// of checkpoint c (read from repo): each pinned, the disk image described.
func followParts(ctx context.Context, doc *InspectResult, repo ociimage.Repository, c *ociimage.Checkpoint, opts []ociimage.Option) error {
	doc.Checkpoint = &CheckpointImages{VMState: doc.Image}
	if !c.Legacy {
		doc.Checkpoint.Image, doc.Checkpoint.Digest = c.Ref.String(), c.Ref.Digest.String()
	}
	if p, ok := c.Part(ociimage.PartDisk); ok {
		d, err := c.Open(ctx, repo, p, opts...)
		if err == nil {
			doc.LinkedDisk, _, err = describe(ctx, d, opts)
		}
		if err != nil {
			return errcode.Wrap(errcode.Of(err), err, "the checkpoint's disk image %s", p.Ref)
		}
		if doc.LinkedDisk.Disk == nil {
			return errcode.New(errcode.InvalidInput, "the checkpoint's disk image %s is a %s image, not a disk image", p.Ref, doc.LinkedDisk.ArtifactType)
		}
		doc.Checkpoint.Disk = doc.LinkedDisk.Image
	}
	if p, ok := c.Part(ociimage.PartRootfs); ok {
		r, err := c.Open(ctx, repo, p, opts...)
		if err == nil {
			doc.LinkedRootfs, err = inspectRootfs(ctx, r)
		}
		if err != nil {
			return errcode.Wrap(errcode.Of(err), err, "the checkpoint's rootfs image %s", p.Ref)
		}
		doc.Checkpoint.Rootfs = doc.LinkedRootfs.Image
		if path := c.Annotations[ociimage.AnnotationDiskRootfsPath]; path != "" {
			doc.Checkpoint.DiskInRootfs = &api.DiskInRootfs{Image: doc.LinkedRootfs.Image, Digest: doc.LinkedRootfs.Digest, Path: path}
		}
	}
	return nil
}

// describe describes the VM state or disk image repo is pinned to, and
// returns its manifest; a disk image lists the state images that refer to
// it through their subject.
func describe(ctx context.Context, repo ociimage.Repository, opts []ociimage.Option) (*InspectResult, ocispec.Manifest, error) {
	desc, err := repo.Resolve(ctx)
	if err != nil {
		return nil, ocispec.Manifest{}, err
	}
	m, err := repo.Manifest(ctx, desc)
	if err != nil {
		return nil, m, err
	}
	ref := repo.Reference()
	doc := &InspectResult{
		Image: ref.WithDigest(desc.Digest).String(), Digest: desc.Digest.String(),
		ArtifactType: m.ArtifactType, Chunks: len(m.Layers), Annotations: m.Annotations,
	}
	describeLayers(doc, m)
	switch m.ArtifactType {
	case ociimage.ArtifactTypeVMState:
		doc.VMState, err = imageConfig(ctx, repo, m.ArtifactType, len(doc.EncryptedFor) > 0, vmstate.LoadConfig)
	case ociimage.ArtifactTypeDisk:
		doc.Disk, err = imageConfig(ctx, repo, m.ArtifactType, len(doc.EncryptedFor) > 0, disk.LoadDiskConfig)
		if err == nil {
			doc.Referrers, err = stateReferrers(ctx, repo, desc)
		}
	default:
		err = errcode.New(errcode.InvalidInput, "%s is not a vmsnap image (artifact type %q)", ref, m.ArtifactType)
	}
	if err != nil {
		return nil, m, err
	}
	return doc, m, nil
}

// imageConfig reads the config of an image of artifactType: checked by
// load, or, for an encrypted image, as the plaintext it is (without a key
// the chunks cannot be checked).
func imageConfig[C any](ctx context.Context, repo ociimage.Repository, artifactType string, encrypted bool,
	load func(context.Context, ociimage.Repository) (ocispec.Descriptor, ocispec.Manifest, C, error)) (*C, error) {
	var cfg C
	var err error
	if encrypted {
		_, _, err = ociimage.PullArtifact(ctx, repo, artifactType, &cfg)
	} else {
		_, _, cfg, err = load(ctx, repo)
	}
	return &cfg, err
}

// describeLayers counts m's layers by kind, and the keys they are
// encrypted for.
func describeLayers(doc *InspectResult, m ocispec.Manifest) {
	kinds := map[string]*LayerKind{}
	for _, l := range m.Layers {
		doc.StoredBytes += l.Size
		for _, id := range imgcrypt.EncryptedFor(l) {
			if !slices.Contains(doc.EncryptedFor, id) {
				doc.EncryptedFor = append(doc.EncryptedFor, id)
			}
		}
		kind := layerKind(l.MediaType)
		k := kinds[kind]
		if k == nil {
			doc.Layers = append(doc.Layers, LayerKind{Kind: kind})
			k = &doc.Layers[len(doc.Layers)-1]
			kinds[kind] = k
		}
		k.Count++
		k.Bytes += l.Size
		k.Largest = max(k.Largest, l.Size)
	}
}

// stateReferrers are the VM state images whose subject is the disk image
// desc names: how checkpoints linked their disk before the checkpoint index.
func stateReferrers(ctx context.Context, repo ociimage.Repository, desc ocispec.Descriptor) ([]Referrer, error) {
	refs, err := repo.Referrers(ctx, desc)
	if err != nil {
		return nil, err
	}
	var out []Referrer
	for _, r := range refs {
		// Some registries report the config's media type as the
		// artifact type of a referrer.
		if r.ArtifactType == ociimage.ArtifactTypeVMState || r.ArtifactType == ociimage.MediaTypeVMStateConfig {
			out = append(out, Referrer{
				Image: repo.Reference().WithDigest(r.Digest).String(), Digest: r.Digest.String(),
				ArtifactType: ociimage.ArtifactTypeVMState, Annotations: r.Annotations,
			})
		}
	}
	return out, nil
}

// inspectRootfs describes the captured container image repo is pinned
// to, by its manifest.
func inspectRootfs(ctx context.Context, repo ociimage.Repository) (*RootfsLink, error) {
	ref := repo.Reference()
	desc, err := repo.Resolve(ctx)
	if err != nil {
		return nil, err
	}
	m, err := repo.Manifest(ctx, desc)
	if err != nil {
		return nil, err
	}
	if m.ArtifactType != "" || m.Config.MediaType != ocispec.MediaTypeImageConfig || len(m.Layers) == 0 {
		return nil, errcode.New(errcode.InvalidInput, "%s is not a container image (artifact type %q, config %q, %d layers)", ref, m.ArtifactType, m.Config.MediaType, len(m.Layers))
	}
	top := m.Layers[len(m.Layers)-1]
	d := &RootfsLink{
		Image: ref.WithDigest(desc.Digest).String(), Digest: desc.Digest.String(), Layers: len(m.Layers),
		BaseImage: m.Annotations[ocispec.AnnotationBaseImageName], Layer: top.Digest.String(), LayerBytes: top.Size,
	}
	for _, l := range m.Layers {
		d.Bytes += l.Size
	}
	return d, nil
}

// layerKind names a layer's media type for people.
func layerKind(mediaType string) string {
	switch strings.TrimSuffix(mediaType, ociimage.MediaTypeEncryptedSuffix) {
	case ociimage.MediaTypeChunk:
		return "chunk"
	case ociimage.MediaTypeRAMPageMap:
		return "ram-pagemap"
	case ociimage.MediaTypeRAMRegion:
		return "ram-region"
	case ociimage.MediaTypeRAMIndex:
		return "ram-index"
	case ociimage.MediaTypeRAMPack:
		return "ram-pack"
	}
	return mediaType
}
