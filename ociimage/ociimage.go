// Package ociimage stores vmsnap's snapshots as OCI images: it parses image
// references, and reads and writes manifests, configs and blobs in an OCI
// image layout on local disk (oci:DIR) or in a registry.
//
// It knows nothing of QEMU or qcow2: a snapshot reaches it as a list of
// already-compressed chunk blobs, a config and an artifact type. Every byte it
// returns has been checked against its digest and declared size; every limit
// on sizes lives in mediatypes.go.
//
// It owns: references (oci:DIR[:TAG|@DIGEST], HOST[:PORT]/REPO[:TAG|@DIGEST]);
// the Repository interface over a layout (layout*.go) and a registry
// (registry*.go; credentials from a Docker config directory, TLS verified,
// plain HTTP only for a host named insecure, per-request deadlines and
// retries); the checkpoint index that ties a checkpoint's images together and
// the links between repositories (checkpoint*.go, link.go, legacy.go);
// retention's optional interfaces (retention.go); cosign-compatible
// signatures (Sign, VerifySignature); the wrappers of a repository
// (wrap.go); and every media type, annotation key and size limit
// (mediatypes.go), those of encryption included. docs/image-format.md
// specifies what it writes.
//
// Encryption is package imgcrypt's, a Wrapper that Open puts above the
// store and its signatures (imgcrypt.WithEncryption); the PEM key files
// of signing and encryption are read by ociimage/internal/pemkey.
//
// It is not a general image library: it writes one image manifest per image
// of a checkpoint and one image index per checkpoint, and reads only those
// (no platforms, no foreign indexes). It must not tag before everything a
// tag names is stored (PutManifest never tags; TagManifest is a call of its
// own), and must not return a byte it has not checked against its digest
// (the one fetch that skips the digest, BlobUnhashed, is for imgcrypt
// alone, which checks the plaintext's: see ociimage/internal/unhashed).
package ociimage

import (
	"context"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Repository is one place snapshots are stored: an OCI layout directory or a
// registry repository. Implementations are safe for concurrent use.
type Repository interface {
	// Reference is what the repository was opened from.
	Reference() Reference

	// HasBlob reports whether the store already holds the blob, so that a
	// writer can skip it.
	HasBlob(ctx context.Context, d digest.Digest) (bool, error)
	// PutBlob stores data as the blob desc describes. It refuses data whose
	// digest or size differ from desc (DIGEST_MISMATCH). Concurrent puts of
	// the same blob are fine. A blob is visible to Blob only once complete.
	PutBlob(ctx context.Context, desc ocispec.Descriptor, data []byte) error
	// PutManifest stores the manifest by its digest, whatever tag the
	// reference has: tagging is a call of its own (TagManifest), made once
	// every manifest of a snapshot is stored, so that a failed snapshot is
	// never tagged. Call it once every blob the manifest names is stored.
	PutManifest(ctx context.Context, m ocispec.Manifest) (ocispec.Descriptor, error)
	// PutIndex stores an image index by its digest, once every manifest
	// it lists is stored; like PutManifest it tags nothing.
	PutIndex(ctx context.Context, idx ocispec.Index) (ocispec.Descriptor, error)
	// TagManifest points tag at the manifest or index desc names, which
	// the repository must hold already (see the package's TagManifest).
	TagManifest(ctx context.Context, desc ocispec.Descriptor, tag string) error

	// Resolve returns the descriptor of the manifest the reference names, by
	// its digest, or by its tag.
	Resolve(ctx context.Context) (ocispec.Descriptor, error)
	// ResolveTag returns the descriptor of the manifest tag names in the
	// repository, whatever tag or digest the reference has (ErrNotFound
	// if it names none): the tag is the call's, as TagManifest's is.
	ResolveTag(ctx context.Context, tag string) (ocispec.Descriptor, error)
	// Manifest fetches and verifies a manifest (digest, size, media type,
	// MaxManifestSize, MaxLayers) and returns it parsed.
	Manifest(ctx context.Context, desc ocispec.Descriptor) (ocispec.Manifest, error)
	// Index fetches and verifies an image index (digest, size, media type,
	// MaxManifestSize) and returns it parsed.
	Index(ctx context.Context, desc ocispec.Descriptor) (ocispec.Index, error)
	// Blob fetches a whole blob, refusing one larger than limit before a
	// byte is read, and verifies its digest (DIGEST_MISMATCH) and size.
	Blob(ctx context.Context, desc ocispec.Descriptor, limit int64) ([]byte, error)

	// Referrers lists the manifests in the repository whose subject is the
	// manifest desc names (a disk image's VM state images), each described
	// with its artifact type and annotations. None is not an error.
	Referrers(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error)
}

// Pinned is repo seen through a reference pinned to the manifest desc
// names: Reference carries desc's digest and Resolve returns desc, without
// a request. Everything else is repo's.
func Pinned(repo Repository, desc ocispec.Descriptor) Repository {
	return pinned{Repository: repo, desc: desc}
}

type pinned struct {
	Repository
	desc ocispec.Descriptor
}

func (p pinned) Reference() Reference {
	return p.Repository.Reference().WithDigest(p.desc.Digest)
}

func (p pinned) Resolve(context.Context) (ocispec.Descriptor, error) { return p.desc, nil }

// Unwrap returns the repository underneath, so that what it wraps
// (TransformsReads, Underlying) is seen through the pin.
func (p pinned) Unwrap() Repository { return p.Repository }
