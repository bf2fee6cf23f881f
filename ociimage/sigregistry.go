package ociimage

import (
	"context"
	"net/http"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Shortcuts a registry takes for signatures, where every request is a
// round trip (and, on a registry with basic auth, a password check):
// Sign stores a signature manifest under its tag in one PUT, and
// VerifySignature reads one by its tag in one GET. Other stores do the
// same in the Repository calls (atTagPutter, atTagFetcher are found by
// type assertion).

// atTagPutter stores a manifest, whose blobs are stored, under a tag.
type atTagPutter interface {
	putAtTag(ctx context.Context, m ocispec.Manifest, tag string) (ocispec.Descriptor, error)
}

// atTagFetcher reads the manifest a tag names, refusing one larger than
// limit before it is read. A tag that names none is ErrNotFound.
type atTagFetcher interface {
	fetchAtTag(ctx context.Context, tag string, limit int64) (ocispec.Descriptor, ocispec.Manifest, error)
}

// putAtTag stores m under tag in store, in one request where it can.
func putAtTag(ctx context.Context, store Repository, m ocispec.Manifest, tag string) (ocispec.Descriptor, error) {
	if p, ok := store.(atTagPutter); ok {
		return p.putAtTag(ctx, m, tag)
	}
	desc, err := store.PutManifest(ctx, m)
	if err != nil {
		return desc, err
	}
	return desc, store.TagManifest(ctx, desc, tag)
}

// fetchAtTag reads the manifest tag names in store, bounded by limit.
func fetchAtTag(ctx context.Context, store Repository, tag string, limit int64) (ocispec.Descriptor, ocispec.Manifest, error) {
	if f, ok := store.(atTagFetcher); ok {
		return f.fetchAtTag(ctx, tag, limit)
	}
	desc, err := store.ResolveTag(ctx, tag)
	if err != nil {
		return desc, ocispec.Manifest{}, err
	}
	if err := checkSignatureManifest(tag, desc, limit); err != nil {
		return desc, ocispec.Manifest{}, err
	}
	m, err := store.Manifest(ctx, desc)
	return desc, m, err
}

// checkSignatureManifest refuses, before it is read, a signature manifest
// that is not an OCI image manifest or is larger than limit.
func checkSignatureManifest(tag string, desc ocispec.Descriptor, limit int64) error {
	if desc.MediaType != ocispec.MediaTypeImageManifest {
		return errcode.New(errcode.InvalidInput, "its signature tag %s names a %q, not an OCI image manifest (cosign with COSIGN_DOCKER_MEDIA_TYPES writes Docker manifests, which vmsnap does not read)", tag, clip(desc.MediaType))
	}
	if desc.Size < 0 || desc.Size > limit {
		return tooLargeSignatures(tag, desc.Size)
	}
	return nil
}

func tooLargeSignatures(tag string, n int64) error {
	return errcode.New(errcode.InvalidInput, "its signature manifest %s is said to be %d bytes, more than the %d vmsnap reads", tag, n, MaxSignatureManifestSize)
}

// putAtTag PUTs m to the tag: the registry stores it by digest too and
// refuses it if a blob it names is missing.
func (r *Registry) putAtTag(ctx context.Context, m ocispec.Manifest, tag string) (ocispec.Descriptor, error) {
	m, b, desc, err := encodeManifest(m)
	if err != nil {
		return desc, err
	}
	if err := checkTagging(ctx, r.ref, desc, tag); err != nil {
		return desc, err
	}
	if err := r.checkBlobs(ctx, m); err != nil {
		return desc, err
	}
	raw := rawManifest{data: b, mediaType: types.MediaType(desc.MediaType)}
	err = r.withRetry(ctx, "storing the manifest "+string(desc.Digest)+" as "+tag, desc.Size, func(ctx context.Context) error {
		return r.pusher.Put(ctx, r.repo.Tag(tag), raw)
	})
	return desc, err
}

// fetchAtTag GETs the manifest tag names, at most limit bytes, and
// describes it by the digest of what was read.
func (r *Registry) fetchAtTag(ctx context.Context, tag string, limit int64) (ocispec.Descriptor, ocispec.Manifest, error) {
	if err := checkTag(r.ref.WithDigest("").String()+":"+tag, tag); err != nil {
		return ocispec.Descriptor{}, ocispec.Manifest{}, err
	}
	var b []byte
	var mt string
	err := r.withRetry(ctx, "reading tag "+tag, 0, func(ctx context.Context) error {
		resp, err := r.send(ctx, http.MethodGet, r.url("manifests", tag), manifestAccept)
		if err != nil {
			return err
		}
		defer drain(resp)
		if resp.StatusCode == http.StatusNotFound {
			return r.notFound(tag, false)
		}
		if err := transport.CheckError(resp, http.StatusOK); err != nil {
			return err
		}
		if mt = mediaType(resp.Header.Get("Content-Type")); mt != ocispec.MediaTypeImageManifest {
			return checkSignatureManifest(tag, ocispec.Descriptor{MediaType: mt}, limit)
		}
		b, err = readBounded(resp, limit, func(n int64) error { return tooLargeSignatures(tag, n) })
		return err
	})
	if err != nil {
		return ocispec.Descriptor{}, ocispec.Manifest{}, err
	}
	desc := ocispec.Descriptor{MediaType: mt, Digest: digest.FromBytes(b), Size: int64(len(b))}
	m, err := decodeManifest(b)
	if err != nil {
		return desc, m, errcode.Wrap(errcode.InvalidInput, err, "tag %s in %s", tag, r.where())
	}
	return desc, m, nil
}
