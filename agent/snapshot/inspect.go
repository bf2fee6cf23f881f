package snapshot

import (
	"context"
	"slices"
	"strings"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/rootfs/overlay"
	"github.com/vmsnap/vmsnap/vmstate"
)

// InspectSpec is one inspect of an image.
type InspectSpec struct {
	Image string // REF, REF:TAG or REF@sha256:...
	Store []ociimage.Option
}

// Inspect describes a vmsnap image, every byte read verified; for a VM
// state image it follows the links to the disk and rootfs images of its
// checkpoint, for a disk image it lists the VM state images that refer to
// it. Nothing is restored.
func Inspect(ctx context.Context, s InspectSpec) (*api.InspectResult, error) {
	ref, err := ociimage.ParseReference(s.Image)
	if err != nil {
		return nil, err
	}
	return inspectRef(ctx, ref, true, s.Store)
}

// resolveManifest opens ref and returns its manifest, verified.
func resolveManifest(ctx context.Context, ref ociimage.Reference, opts []ociimage.Option) (ocispec.Descriptor, ocispec.Manifest, error) {
	repo, err := ociimage.Open(ctx, ref, opts...)
	if err != nil {
		return ocispec.Descriptor{}, ocispec.Manifest{}, err
	}
	desc, err := repo.Resolve(ctx)
	if err != nil {
		return desc, ocispec.Manifest{}, err
	}
	m, err := repo.Manifest(ctx, desc)
	return desc, m, err
}

func inspectRef(ctx context.Context, ref ociimage.Reference, follow bool, opts []ociimage.Option) (*api.InspectResult, error) {
	desc, m, err := resolveManifest(ctx, ref, opts)
	if err != nil {
		return nil, err
	}
	doc := &api.InspectResult{
		Image: ref.WithDigest(desc.Digest).String(), Digest: desc.Digest.String(),
		ArtifactType: m.ArtifactType, Chunks: len(m.Layers), Annotations: m.Annotations,
	}
	kinds := map[string]*api.LayerKind{}
	for _, l := range m.Layers {
		doc.StoredBytes += l.Size
		for _, id := range ociimage.EncryptedFor(l) {
			if !slices.Contains(doc.EncryptedFor, id) {
				doc.EncryptedFor = append(doc.EncryptedFor, id)
			}
		}
		kind := layerKind(l.MediaType)
		k := kinds[kind]
		if k == nil {
			doc.Layers = append(doc.Layers, api.LayerKind{Kind: kind})
			k = &doc.Layers[len(doc.Layers)-1]
			kinds[kind] = k
		}
		k.Count++
		k.Bytes += l.Size
		k.Largest = max(k.Largest, l.Size)
	}
	pinned, err := ociimage.Open(ctx, ref.WithDigest(desc.Digest), opts...)
	if err != nil {
		return nil, err
	}
	switch m.ArtifactType {
	case ociimage.ArtifactTypeVMState:
		var cfg vmstate.Config
		if len(doc.EncryptedFor) > 0 {
			// Without a key the chunks cannot be checked, but the config is
			// plaintext.
			_, _, err = ociimage.PullArtifact(ctx, pinned, ociimage.ArtifactTypeVMState, &cfg)
		} else {
			_, _, cfg, err = vmstate.LoadConfig(ctx, pinned)
		}
		if err != nil {
			return nil, err
		}
		doc.VMState = &cfg
		if !follow {
			break
		}
		doc.Checkpoint = &api.CheckpointImages{VMState: doc.Image}
		if link := m.Annotations[ociimage.AnnotationDiskImage]; link != "" {
			dref, err := ociimage.ParseReference(link)
			if err != nil {
				return nil, errcode.Wrap(errcode.InvalidInput, err, "the image's linked disk reference")
			}
			if doc.LinkedDisk, err = inspectRef(ctx, dref, false, opts); err != nil {
				return nil, errcode.Wrap(errcode.Of(err), err, "the linked disk image %s", link)
			}
			if doc.LinkedDisk.Disk == nil {
				return nil, errcode.New(errcode.InvalidInput, "the linked disk image %s is a %s image, not a disk image", link, doc.LinkedDisk.ArtifactType)
			}
			doc.Checkpoint.Disk = doc.LinkedDisk.Image
		}
		if link := m.Annotations[ociimage.AnnotationRootfsImage]; link != "" {
			if doc.LinkedRootfs, err = inspectRootfs(ctx, link, opts); err != nil {
				return nil, errcode.Wrap(errcode.Of(err), err, "the linked rootfs image %s", link)
			}
			doc.Checkpoint.Rootfs = doc.LinkedRootfs.Image
			if p := m.Annotations[ociimage.AnnotationDiskRootfsPath]; p != "" {
				doc.Checkpoint.DiskInRootfs = &api.DiskInRootfs{Image: doc.LinkedRootfs.Image, Digest: doc.LinkedRootfs.Digest, Path: p}
			}
		}
	case ociimage.ArtifactTypeDisk:
		var cfg overlay.DiskConfig
		if len(doc.EncryptedFor) > 0 {
			_, _, err = ociimage.PullArtifact(ctx, pinned, ociimage.ArtifactTypeDisk, &cfg)
		} else {
			_, _, cfg, err = overlay.LoadDiskConfig(ctx, pinned)
		}
		if err != nil {
			return nil, err
		}
		doc.Disk = &cfg
		if follow {
			refs, err := pinned.Referrers(ctx, desc)
			if err != nil {
				return nil, err
			}
			for _, r := range refs {
				// Some registries report the config's media type as the
				// artifact type of a referrer.
				if r.ArtifactType == ociimage.ArtifactTypeVMState || r.ArtifactType == ociimage.MediaTypeVMStateConfig {
					doc.Referrers = append(doc.Referrers, api.Referrer{
						Image: ref.WithDigest(r.Digest).String(), Digest: r.Digest.String(),
						ArtifactType: ociimage.ArtifactTypeVMState, Annotations: r.Annotations,
					})
				}
			}
		}
	default:
		return nil, errcode.New(errcode.InvalidInput, "%s is not a vmsnap image (artifact type %q)", ref, m.ArtifactType)
	}
	return doc, nil
}

// inspectRootfs describes a captured container image by its manifest.
func inspectRootfs(ctx context.Context, link string, opts []ociimage.Option) (*api.RootfsLink, error) {
	ref, err := ociimage.ParseReference(link)
	if err != nil {
		return nil, err
	}
	desc, m, err := resolveManifest(ctx, ref, opts)
	if err != nil {
		return nil, err
	}
	if m.ArtifactType != "" || m.Config.MediaType != ocispec.MediaTypeImageConfig || len(m.Layers) == 0 {
		return nil, errcode.New(errcode.InvalidInput, "%s is not a container image (artifact type %q, config %q, %d layers)", ref, m.ArtifactType, m.Config.MediaType, len(m.Layers))
	}
	top := m.Layers[len(m.Layers)-1]
	d := &api.RootfsLink{
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
	}
	return mediaType
}
