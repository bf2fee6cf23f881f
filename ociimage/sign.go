package ociimage

import (
	"bytes"
	"context"
	"encoding/base64"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"

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
	// The payload and the config of a first signature go up while the
	// store is asked for the signatures already there (usually none: a
	// checkpoint signs what it has just made); a later signature makes
	// the config again.
	m, cfg, err := signatureManifest([]ocispec.Descriptor{layer})
	if err != nil {
		return err
	}
	var old ocispec.Manifest
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		var err error
		old, _, err = fetchSignatures(gctx, store, desc.Digest)
		return errcode.Ensure(errcode.RegistryError, err, "reading the signatures of %s", desc.Digest)
	})
	g.Go(func() error { return store.PutBlob(gctx, layer, p) })
	g.Go(func() error { return store.PutBlob(gctx, m.Config, cfg) })
	if err := g.Wait(); err != nil {
		return err
	}
	if len(old.Layers) > 0 {
		if m, cfg, err = signatureManifest(append(old.Layers, layer)); err != nil {
			return err
		}
		if err := store.PutBlob(ctx, m.Config, cfg); err != nil {
			return err
		}
	}
	_, err = putAtTag(ctx, store, m, SignatureTag(desc.Digest))
	return err
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

// PutManifest stores m and signs it at once: the digest is known before m
// is stored, and a signature names only that digest, so the two go up
// side by side. A signature of a manifest whose store then fails signs
// nothing that exists.
func (s *signing) PutManifest(ctx context.Context, m ocispec.Manifest) (ocispec.Descriptor, error) {
	_, _, want, err := encodeManifest(m)
	if err != nil {
		return s.Repository.PutManifest(ctx, m) // which refuses it, as it would unsigned
	}
	return s.putSigned(ctx, want, func(ctx context.Context) (ocispec.Descriptor, error) {
		return s.Repository.PutManifest(ctx, m)
	})
}

// PutIndex stores idx and signs it as PutManifest does a manifest: a
// checkpoint's index is what its digest names, so it is what cosign
// verify is given and what a restore verifies first.
func (s *signing) PutIndex(ctx context.Context, idx ocispec.Index) (ocispec.Descriptor, error) {
	_, want, err := encodeIndex(idx)
	if err != nil {
		return s.Repository.PutIndex(ctx, idx)
	}
	return s.putSigned(ctx, want, func(ctx context.Context) (ocispec.Descriptor, error) {
		return s.Repository.PutIndex(ctx, idx)
	})
}

// putSigned runs put, which stores want, beside the signature of want.
func (s *signing) putSigned(ctx context.Context, want ocispec.Descriptor, put func(context.Context) (ocispec.Descriptor, error)) (ocispec.Descriptor, error) {
	var desc ocispec.Descriptor
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		var err error
		desc, err = put(gctx)
		return err
	})
	g.Go(func() error {
		return errcode.Ensure(errcode.RegistryError, Sign(gctx, s.Repository, want, s.key), "signing %s", want.Digest)
	})
	if err := g.Wait(); err != nil {
		return desc, err
	}
	if desc.Digest != want.Digest {
		return desc, errcode.New(errcode.Internal, "%s was stored as %s but signed as %s", want.MediaType, desc.Digest, want.Digest)
	}
	return desc, nil
}
