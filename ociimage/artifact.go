package ociimage

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"strings"

	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Artifact is one snapshot image as its writer sees it: a typed config and
// the chunk layers, already stored with PutBlob.
type Artifact struct {
	ArtifactType    string // ArtifactTypeVMState or ArtifactTypeDisk
	ConfigMediaType string // the config media type that goes with ArtifactType
	Config          any    // marshalled to JSON as the config blob
	Layers          []ocispec.Descriptor
	Annotations     map[string]string
	Subject         *ocispec.Descriptor
}

// PushArtifact stores a's config blob and then its manifest, by digest
// (TagManifest tags it). The layers must be stored already. It returns the manifest's descriptor.
func PushArtifact(ctx context.Context, repo Repository, a Artifact) (ocispec.Descriptor, error) {
	if a.ArtifactType == "" || a.ConfigMediaType == "" {
		return ocispec.Descriptor{}, errcode.New(errcode.Internal, "PushArtifact needs an artifact type and a config media type")
	}
	// Refuse here what PullArtifact would refuse, so that no unreadable
	// image is ever written.
	if err := checkChunkLayers(a.Layers); err != nil {
		return ocispec.Descriptor{}, err
	}
	cfg, err := json.Marshal(a.Config)
	if err != nil {
		return ocispec.Descriptor{}, errcode.Wrap(errcode.Internal, err, "cannot encode the %s config", describeArtifact(a.ArtifactType, a.ConfigMediaType))
	}
	if len(cfg) > MaxConfigSize {
		return ocispec.Descriptor{}, errcode.New(errcode.InvalidInput, "the config is %d bytes, more than the %d a config may have", len(cfg), MaxConfigSize)
	}
	cfgDesc := ocispec.Descriptor{MediaType: a.ConfigMediaType, Digest: digest.FromBytes(cfg), Size: int64(len(cfg))}
	if err := repo.PutBlob(ctx, cfgDesc, cfg); err != nil {
		return ocispec.Descriptor{}, err
	}
	return repo.PutManifest(ctx, ocispec.Manifest{
		Versioned:    specs.Versioned{SchemaVersion: 2},
		MediaType:    ocispec.MediaTypeImageManifest,
		ArtifactType: a.ArtifactType,
		Config:       cfgDesc,
		Layers:       a.Layers,
		Subject:      a.Subject,
		Annotations:  a.Annotations,
	})
}

// TagManifest points tag, in repo, at the manifest desc names, which repo
// must already hold (PutManifest stores by digest only).
// Nothing else moves: the tag's previous manifest stays, reachable by its
// digest. This is how the images of one checkpoint are committed together:
// each is stored by digest first, and their tags move only once all of them
// are stored, the VM state's last.
//
// Errors: an invalid tag or descriptor is INVALID_INPUT; a manifest repo does
// not hold is REGISTRY_ERROR (a corrupt one DIGEST_MISMATCH); the store's own
// failures keep their codes.
func TagManifest(ctx context.Context, repo Repository, desc ocispec.Descriptor, tag string) error {
	return repo.TagManifest(ctx, desc, tag)
}

// checkTagging refuses what TagManifest must not do, before the store is
// asked anything.
func checkTagging(ctx context.Context, ref Reference, desc ocispec.Descriptor, tag string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := checkTag(ref.WithDigest("").String()+":"+tag, tag); err != nil {
		return err
	}
	if desc.MediaType != ocispec.MediaTypeImageManifest && desc.MediaType != ocispec.MediaTypeImageIndex {
		return errcode.New(errcode.InvalidInput, "cannot tag %s as %s: it is a %q, not an image manifest or index", desc.Digest, tag, desc.MediaType)
	}
	return checkFetch("manifest", desc, MaxManifestSize)
}

// checkMediaTypeOf refuses manifest bytes b whose own media type is not
// the one desc gives them: a tag must not present a manifest as an index.
func checkMediaTypeOf(b []byte, desc ocispec.Descriptor) error {
	var head struct {
		MediaType string `json:"mediaType"`
	}
	if err := json.Unmarshal(b, &head); err != nil || head.MediaType != desc.MediaType {
		return errcode.New(errcode.InvalidInput, "cannot tag %s: it is not a %s", desc.Digest, desc.MediaType)
	}
	return nil
}

// TagManifest points tag at the manifest desc names, which the layout must
// hold whole: its bytes are verified against desc first. index.json is
// updated under the layout's lock, as PutManifest updates it.
func (l *Layout) TagManifest(ctx context.Context, desc ocispec.Descriptor, tag string) error {
	if err := checkTagging(ctx, l.ref, desc, tag); err != nil {
		return err
	}
	if err := l.checkLayout(); err != nil {
		return err
	}
	b, err := l.readBlob(ctx, "manifest", desc, MaxManifestSize)
	if err != nil {
		return err
	}
	if err := checkMediaTypeOf(b, desc); err != nil {
		return err
	}
	idx, unlock, err := l.lockedIndex(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	addToIndex(&idx, ocispec.Descriptor{MediaType: desc.MediaType, Digest: desc.Digest, Size: desc.Size, ArtifactType: desc.ArtifactType}, tag)
	return l.writeIndex(idx)
}

// TagManifest points tag at the manifest desc names: it fetches the
// manifest's bytes by digest (verified) and puts them again under the tag,
// as PutManifest would have, so a registry that does not hold the manifest
// (or some blob it names) refuses.
func (r *Registry) TagManifest(ctx context.Context, desc ocispec.Descriptor, tag string) error {
	if err := checkTagging(ctx, r.ref, desc, tag); err != nil {
		return err
	}
	b, err := r.fetch(ctx, "manifest", desc, MaxManifestSize)
	if err != nil {
		return err
	}
	if err := checkMediaTypeOf(b, desc); err != nil {
		return err
	}
	raw := rawManifest{data: b, mediaType: types.MediaType(desc.MediaType)}
	return r.withRetry(ctx, "tagging manifest "+string(desc.Digest)+" as "+tag, desc.Size, func(ctx context.Context) error {
		return r.pusher.Put(ctx, r.repo.Tag(tag), raw)
	})
}

// PullArtifact resolves repo's reference, checks that it is an artifactType
// image vmsnap can read, and decodes its config into configOut, refusing
// fields configOut does not know. It returns the manifest's descriptor and
// the manifest; the chunks are the caller's to fetch.
func PullArtifact(ctx context.Context, repo Repository, artifactType string, configOut any) (ocispec.Descriptor, ocispec.Manifest, error) {
	wantConfig := configMediaType(artifactType)
	if wantConfig == "" {
		return ocispec.Descriptor{}, ocispec.Manifest{}, errcode.New(errcode.Internal, "PullArtifact: unknown artifact type %q", artifactType)
	}
	ref := repo.Reference()
	desc, err := repo.Resolve(ctx)
	if err != nil {
		return ocispec.Descriptor{}, ocispec.Manifest{}, err
	}
	m, err := repo.Manifest(ctx, desc)
	if err != nil {
		return ocispec.Descriptor{}, ocispec.Manifest{}, err
	}
	if m.ArtifactType != artifactType {
		return ocispec.Descriptor{}, ocispec.Manifest{}, errcode.New(errcode.InvalidInput, "%s is a %s, not a %s; check the reference",
			ref, describeArtifact(m.ArtifactType, m.Config.MediaType), describeArtifact(artifactType, wantConfig))
	}
	if m.Config.MediaType != wantConfig {
		return ocispec.Descriptor{}, ocispec.Manifest{}, errcode.New(errcode.InvalidInput,
			"%s has a config of type %q, not %s; it was not written by this version of vmsnap", ref, clip(m.Config.MediaType), wantConfig)
	}
	if err := checkChunkLayers(m.Layers); err != nil {
		return ocispec.Descriptor{}, ocispec.Manifest{}, errcode.Ensure(errcode.InvalidInput, err, "%s", ref)
	}

	cfg, err := repo.Blob(ctx, m.Config, MaxConfigSize)
	if err != nil {
		return ocispec.Descriptor{}, ocispec.Manifest{}, err
	}
	dec := json.NewDecoder(bytes.NewReader(cfg))
	// An unknown field is data this version would silently ignore, most
	// likely a setting from a newer vmsnap that restore must honour.
	dec.DisallowUnknownFields()
	if err := dec.Decode(configOut); err != nil {
		return ocispec.Descriptor{}, ocispec.Manifest{}, errcode.Wrap(errcode.InvalidInput, err,
			"cannot read the config of %s; if a newer vmsnap wrote it, upgrade vmsnap", ref)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return ocispec.Descriptor{}, ocispec.Manifest{}, errcode.New(errcode.InvalidInput, "the config of %s has data after its JSON object", ref)
	}
	return desc, m, nil
}

// checkChunkLayers checks that every layer is a blob of vmsnap's (a
// stream's chunk, a RAM file's region, page map, index or pack) that vmsnap can hold
// in memory. Errors are INVALID_INPUT.
func checkChunkLayers(layers []ocispec.Descriptor) error {
	for i, l := range layers {
		// An encrypted layer is checked as its plaintext kind: its config
		// is readable without a key (inspect); reading its bytes needs one
		// (imgcrypt.CheckDecrypted).
		limit := int64(MaxChunkSize)
		switch strings.TrimSuffix(l.MediaType, MediaTypeEncryptedSuffix) {
		case MediaTypeChunk, MediaTypeRAMRegion, MediaTypeRAMPageMap, MediaTypeRAMIndex:
		case MediaTypeRAMPack:
			limit = MaxPackSize
		default:
			return errcode.New(errcode.InvalidInput, "layer %d has media type %q, not %s", i, l.MediaType, MediaTypeChunk)
		}
		if l.Size < 0 || l.Size > limit {
			return errcode.New(errcode.InvalidInput, "layer %d is %d bytes, outside the 0 to %d its kind may have", i, l.Size, limit)
		}
	}
	return nil
}
