package ociimage

// The registry client's manifests: putting one once every blob it names is
// stored (never tagging), and fetching one by digest.

import (
	"context"
	"fmt"
	"strings"

	"github.com/google/go-containerregistry/pkg/v1/types"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Media types a manifest GET or HEAD accepts. vmsnap reads only OCI image
// manifests, but asking for the others gets a clear "this is a container
// image index" instead of a registry's MANIFEST_UNKNOWN.
var manifestAccept = strings.Join([]string{
	ocispec.MediaTypeImageManifest, ocispec.MediaTypeImageIndex,
	string(types.DockerManifestSchema2), string(types.DockerManifestList),
}, ", ")

// PutManifest pushes the manifest's exact bytes with its media type, by
// digest: no tag moves (TagManifest does that). Like a layout it refuses a
// manifest whose blobs the registry does not hold. A manifest with a subject
// is listed among the subject's referrers: by the registry if it has the
// referrers API, else in the sha256-HEX tag (the referrers tag schema).
func (r *Registry) PutManifest(ctx context.Context, m ocispec.Manifest) (ocispec.Descriptor, error) {
	if err := ctx.Err(); err != nil {
		return ocispec.Descriptor{}, err
	}
	m, b, desc, err := encodeManifest(m)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	if r.ref.IsDigest() {
		return ocispec.Descriptor{}, errcode.New(errcode.InvalidInput,
			"cannot store a manifest at %s: a digest reference names an existing manifest; push to %s or %s:TAG", r.ref, r.where(), r.where())
	}
	if err := r.checkBlobs(ctx, m); err != nil {
		return ocispec.Descriptor{}, err
	}
	target := r.repo.Digest(desc.Digest.String())
	raw := rawManifest{data: b, mediaType: types.MediaType(desc.MediaType)}
	err = r.withRetry(ctx, "storing the manifest "+string(desc.Digest), desc.Size, func(ctx context.Context) error {
		return r.pusher.Put(ctx, target, raw)
	})
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	return desc, nil
}

// checkBlobs makes sure every blob the manifest names is in the repository,
// asking only about those this Registry has not seen.
func (r *Registry) checkBlobs(ctx context.Context, m ocispec.Manifest) error {
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(8)
	for i, bd := range append([]ocispec.Descriptor{m.Config}, m.Layers...) {
		what := "config"
		if i > 0 {
			what = fmt.Sprintf("layer %d", i-1)
		}
		g.Go(func() error {
			return errcode.Safely(func() error { // the registry's answers are untrusted
				size, ok := r.known.Load(bd.Digest)
				if !ok {
					var have bool
					err := r.withRetry(gctx, "checking for blob "+string(bd.Digest), 0, func(ctx context.Context) error {
						var err error
						var n int64
						n, have, err = r.headBlob(ctx, bd.Digest)
						size = n
						return err
					})
					if err != nil {
						return err
					}
					if !have {
						return errcode.New(errcode.RegistryError,
							"refusing to store the manifest: its %s blob %s is not in %s; store every blob before the manifest", what, bd.Digest, r.where())
					}
					r.remember(bd.Digest, size.(int64))
				}
				if n := size.(int64); n >= 0 && n != bd.Size {
					return errcode.New(errcode.DigestMismatch,
						"refusing to store the manifest: its %s blob %s in %s is %d bytes, not the %d the manifest says", what, bd.Digest, r.where(), n, bd.Size)
				}
				return nil
			})
		})
	}
	return g.Wait()
}

// Manifest fetches the manifest desc names by digest, verifies it and
// parses it.
func (r *Registry) Manifest(ctx context.Context, desc ocispec.Descriptor) (ocispec.Manifest, error) {
	if desc.MediaType != "" && desc.MediaType != ocispec.MediaTypeImageManifest {
		return ocispec.Manifest{}, errcode.New(errcode.InvalidInput,
			"%s in %s is a %s, not an image manifest; vmsnap reads only the image manifests it writes", desc.Digest, r.where(), desc.MediaType)
	}
	b, err := r.fetch(ctx, "manifest", desc, MaxManifestSize)
	if err != nil {
		return ocispec.Manifest{}, err
	}
	m, err := decodeManifest(b)
	if err != nil {
		return ocispec.Manifest{}, errcode.Wrap(errcode.InvalidInput, err, "%s in %s", desc.Digest, r.where())
	}
	return m, nil
}

// rawManifest is a manifest pushed byte for byte, with its media type.
type rawManifest struct {
	data      []byte
	mediaType types.MediaType
}

func (m rawManifest) RawManifest() ([]byte, error)        { return m.data, nil }
func (m rawManifest) MediaType() (types.MediaType, error) { return m.mediaType, nil }
