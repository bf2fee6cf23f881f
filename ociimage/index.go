package ociimage

import (
	"context"
	"fmt"

	"github.com/google/go-containerregistry/pkg/v1/types"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Image indexes: vmsnap writes one per checkpoint (checkpoint.go) and reads
// them back. Like manifests, an index is stored by digest only (tagging is
// TagManifest's) and only once every manifest it lists is stored.

// maxIndexEntries bounds the manifests one index may list.
const maxIndexEntries = 1024

// encodeIndex completes idx (schema version, media type, an empty rather
// than null list), checks it and returns its JSON and the descriptor that
// names it. Errors are INVALID_INPUT.
func encodeIndex(idx ocispec.Index) ([]byte, ocispec.Descriptor, error) {
	completeHead(&idx.SchemaVersion, &idx.MediaType, ocispec.MediaTypeImageIndex)
	if idx.Manifests == nil {
		idx.Manifests = []ocispec.Descriptor{}
	}
	if err := checkIndex(idx); err != nil {
		return nil, ocispec.Descriptor{}, err
	}
	return encodeChecked(idx, "image index", "", idx.MediaType, idx.ArtifactType)
}

// decodeIndex parses verified index bytes and checks them; unknown fields
// are allowed, as the image spec asks of readers.
func decodeIndex(b []byte) (ocispec.Index, error) {
	return decodeChecked(b, "image index", checkIndex)
}

// checkIndex refuses an index vmsnap cannot read safely. Errors are
// INVALID_INPUT.
func checkIndex(idx ocispec.Index) error {
	if err := checkHead("image index", idx.SchemaVersion, idx.MediaType, ocispec.MediaTypeImageIndex); err != nil {
		return err
	}
	if len(idx.Manifests) > maxIndexEntries {
		return errcode.New(errcode.InvalidInput, "image index lists %d manifests, more than the %d vmsnap accepts", len(idx.Manifests), maxIndexEntries)
	}
	for i, d := range idx.Manifests {
		if err := checkDescriptor(fmt.Sprintf("index entry %d", i), d); err != nil {
			return err
		}
	}
	return nil
}

// checkIndexMedia refuses a descriptor that does not name an image index.
func checkIndexMedia(desc ocispec.Descriptor, where string) error {
	if desc.MediaType != "" && desc.MediaType != ocispec.MediaTypeImageIndex {
		return errcode.New(errcode.InvalidInput, "%s in %s is a %s, not an image index", desc.Digest, where, desc.MediaType)
	}
	return nil
}

// PutIndex stores idx by its digest, once every manifest it lists is in the
// layout; nothing is tagged.
func (l *Layout) PutIndex(ctx context.Context, idx ocispec.Index) (ocispec.Descriptor, error) {
	if err := ctx.Err(); err != nil {
		return ocispec.Descriptor{}, err
	}
	b, desc, err := encodeIndex(idx)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	if l.ref.IsDigest() {
		return ocispec.Descriptor{}, errcode.New(errcode.InvalidInput, "cannot store an index at %s: a digest reference names an existing manifest", l.ref)
	}
	if err := l.ensureLayout(ctx); err != nil {
		return ocispec.Descriptor{}, err
	}
	// Under the lock, as a manifest: a manifest listed is one
	// CollectGarbage keeps.
	stored, unlock, err := l.lockedIndex(ctx)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	defer unlock()
	for _, m := range idx.Manifests {
		if _, err := l.readBlob(ctx, "manifest", m, MaxManifestSize); err != nil {
			return ocispec.Descriptor{}, errcode.Wrap(errcode.Of(err), err, "refusing to store the index: a manifest it lists is not stored whole")
		}
	}
	if err := l.putBlob(desc.Digest, b); err != nil {
		return ocispec.Descriptor{}, err
	}
	addToIndex(&stored, desc, "")
	if err := l.writeIndex(stored); err != nil {
		return ocispec.Descriptor{}, err
	}
	return desc, nil
}

// Index reads, verifies and parses the image index desc names.
func (l *Layout) Index(ctx context.Context, desc ocispec.Descriptor) (ocispec.Index, error) {
	if err := checkIndexMedia(desc, l.dir); err != nil {
		return ocispec.Index{}, err
	}
	b, err := l.readBlob(ctx, "index", desc, MaxManifestSize)
	if err != nil {
		return ocispec.Index{}, err
	}
	idx, err := decodeIndex(b)
	if err != nil {
		return ocispec.Index{}, errcode.Wrap(errcode.InvalidInput, err, "%s in %s", desc.Digest, l.dir)
	}
	return idx, nil
}

// PutIndex pushes idx's exact bytes by digest, once the registry holds
// every manifest it lists; nothing is tagged.
func (r *Registry) PutIndex(ctx context.Context, idx ocispec.Index) (ocispec.Descriptor, error) {
	if err := ctx.Err(); err != nil {
		return ocispec.Descriptor{}, err
	}
	b, desc, err := encodeIndex(idx)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	if r.ref.IsDigest() {
		return ocispec.Descriptor{}, errcode.New(errcode.InvalidInput, "cannot store an index at %s: a digest reference names an existing manifest", r.ref)
	}
	for _, m := range idx.Manifests {
		got, err := r.ResolveDigest(ctx, m.Digest)
		if err != nil {
			return ocispec.Descriptor{}, errcode.Wrap(errcode.Of(err), err, "refusing to store the index: a manifest it lists is not in %s", r.where())
		}
		if got.Size != m.Size {
			return ocispec.Descriptor{}, errcode.New(errcode.DigestMismatch, "refusing to store the index: manifest %s in %s is %d bytes, not the %d the index says", m.Digest, r.where(), got.Size, m.Size)
		}
	}
	raw := rawManifest{data: b, mediaType: types.MediaType(desc.MediaType)}
	err = r.withRetry(ctx, "storing the index "+string(desc.Digest), desc.Size, func(ctx context.Context) error {
		return r.pusher.Put(ctx, r.repo.Digest(desc.Digest.String()), raw)
	})
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	return desc, nil
}

// Index fetches the image index desc names by digest, verifies it and
// parses it.
func (r *Registry) Index(ctx context.Context, desc ocispec.Descriptor) (ocispec.Index, error) {
	if err := checkIndexMedia(desc, r.where()); err != nil {
		return ocispec.Index{}, err
	}
	b, err := r.fetch(ctx, "index", desc, MaxManifestSize)
	if err != nil {
		return ocispec.Index{}, err
	}
	idx, err := decodeIndex(b)
	if err != nil {
		return ocispec.Index{}, errcode.Wrap(errcode.InvalidInput, err, "%s in %s", desc.Digest, r.where())
	}
	return idx, nil
}
