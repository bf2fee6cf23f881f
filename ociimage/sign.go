package ociimage

import (
	"bytes"
	"context"
	"encoding/base64"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Sign stores a signature by key of the manifest desc names, as `cosign
// sign --key` does without a transparency log: the simple signing payload
// naming desc's digest (and repo's repository) as a blob, listed with its
// signature in the manifest tagged SignatureTag(desc.Digest) in repo's
// store, after the signatures already there. `cosign verify --key`
// accepts it, and VerifySignature.
//
// Two signers of one manifest at once may lose one signature (the last
// tag wins), as with cosign.
func Sign(ctx context.Context, repo Repository, desc ocispec.Descriptor, key SignKey) error {
	store := Underlying(repo)
	p, err := signaturePayload(store.Reference(), desc.Digest)
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "encoding the signature payload")
	}
	sig, err := key.signer.SignMessage(bytes.NewReader(p))
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "signing %s with %s", desc.Digest, key.Path)
	}
	layer := ocispec.Descriptor{
		MediaType: MediaTypeSimpleSigning, Digest: digest.FromBytes(p), Size: int64(len(p)),
		Annotations: map[string]string{AnnotationCosignSignature: base64.StdEncoding.EncodeToString(sig)},
	}
	old, _, err := fetchSignatures(ctx, store, desc.Digest)
	if err != nil {
		return errcode.Ensure(errcode.RegistryError, err, "reading the signatures of %s", desc.Digest)
	}
	m, cfg, err := signatureManifest(append(old.Layers, layer))
	if err != nil {
		return err
	}
	if err := store.PutBlob(ctx, layer, p); err != nil {
		return err
	}
	if err := store.PutBlob(ctx, m.Config, cfg); err != nil {
		return err
	}
	sigDesc, err := store.PutManifest(ctx, m)
	if err != nil {
		return err
	}
	return store.TagManifest(ctx, sigDesc, SignatureTag(desc.Digest))
}

// WithSigner signs every manifest written (Sign), once it is stored and
// before PutManifest returns, so that a checkpoint whose tag moves is
// signed whole.
func WithSigner(key SignKey) Option {
	return func(o *openOptions) { o.sign = &key }
}

// signing is a Repository whose PutManifest signs what it stored.
type signing struct {
	Repository
	key SignKey
}

// Unwrap returns the repository underneath.
func (s *signing) Unwrap() Repository { return s.Repository }

func (s *signing) PutManifest(ctx context.Context, m ocispec.Manifest) (ocispec.Descriptor, error) {
	desc, err := s.Repository.PutManifest(ctx, m)
	if err != nil {
		return desc, err
	}
	if err := Sign(ctx, s.Repository, desc, s.key); err != nil {
		return desc, errcode.Ensure(errcode.RegistryError, err, "signing the manifest %s", desc.Digest)
	}
	return desc, nil
}
