package ociimage

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// VerifySignature checks that the manifest desc names carries, at its
// signature tag in repo's store (SignatureTag), a signature by one of keys
// of a payload that names desc's digest and repo's repository, as `cosign
// verify --key` checks one (without a transparency log). Everything read
// is bounded and checked against its digest first: whoever can push to the
// repository writes the signatures.
//
// A manifest without such a signature is AUTH_FAILED, the message saying
// what was found instead; a registry that cannot be read keeps its error
// (REGISTRY_ERROR, or AUTH_FAILED for credentials).
func VerifySignature(ctx context.Context, repo Repository, desc ocispec.Descriptor, keys []VerifyKey) error {
	store := Underlying(repo)
	ref := store.Reference()
	if len(keys) == 0 {
		return errcode.New(errcode.Internal, "VerifySignature without a key")
	}
	m, found, err := fetchSignatures(ctx, store, desc.Digest)
	if err == nil && !found {
		err = fmt.Errorf("it has no signature (no tag %s in its repository)", SignatureTag(desc.Digest))
	}
	if err != nil {
		return unverified(ref, desc.Digest, keys, err)
	}
	var findings []string
	for i, l := range m.Layers {
		ok, err := verifyLayer(ctx, store, l, desc.Digest, keys)
		if ok {
			return nil
		}
		if transient(err) {
			return err
		}
		if len(findings) < 3 {
			findings = append(findings, fmt.Sprintf("signature %d: %v", i+1, err))
		}
	}
	if len(findings) == 0 {
		findings = append(findings, "its signature manifest lists no signature")
	}
	return unverified(ref, desc.Digest, keys, errors.New(strings.Join(findings, "; ")))
}

// verifyLayer checks one signature layer: a bounded payload, its
// signature by one of keys, then its claims.
func verifyLayer(ctx context.Context, store Repository, l ocispec.Descriptor, d digest.Digest, keys []VerifyKey) (bool, error) {
	b64 := l.Annotations[AnnotationCosignSignature]
	switch {
	case l.MediaType != MediaTypeSimpleSigning:
		return false, fmt.Errorf("a %q, not a simple signing payload", clip(l.MediaType))
	case b64 == "":
		return false, errors.New("no signature annotation")
	case l.Size < 0 || l.Size > MaxSignaturePayloadSize:
		return false, fmt.Errorf("its payload is said to be %d bytes, more than the %d vmsnap reads", l.Size, MaxSignaturePayloadSize)
	case base64.StdEncoding.DecodedLen(len(b64)) > maxSignatureBytes:
		return false, fmt.Errorf("its signature is longer than the %d bytes vmsnap reads", maxSignatureBytes)
	}
	sig, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		return false, errors.New("its signature is not base64")
	}
	p, err := store.Blob(ctx, l, MaxSignaturePayloadSize)
	if err != nil {
		return false, err
	}
	by := -1
	for i, k := range keys {
		if k.verifier.VerifySignature(bytes.NewReader(sig), bytes.NewReader(p)) == nil {
			by = i
			break
		}
	}
	if by < 0 {
		return false, errors.New("not made by any of the keys given, or its payload was changed")
	}
	if err := checkPayload(p, store.Reference(), d); err != nil {
		return false, fmt.Errorf("made by %s, but %v", keys[by].ID, err)
	}
	return true, nil
}

// transient reports whether err is the store failing to answer (worth a
// retry) rather than a verdict on what it holds.
func transient(err error) bool {
	c := errcode.Of(err)
	return c == errcode.RegistryError && !errors.Is(err, ErrNotFound) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// unverified is the refusal of the manifest d, with why; a store that
// could not be read keeps its own error.
func unverified(ref Reference, d digest.Digest, keys []VerifyKey, why error) error {
	if transient(why) {
		return errcode.Ensure(errcode.RegistryError, why, "reading the signatures of %s", ref.WithDigest(d))
	}
	ids := make([]string, len(keys))
	for i, k := range keys {
		ids[i] = k.ID + " (" + k.Path + ")"
	}
	return errcode.New(errcode.AuthFailed,
		"%s is not signed by any of the keys given (%s): %v; sign it with vmsnap checkpoint --sign-key or cosign sign --key, or give the key that signed it",
		ref.WithDigest(d), strings.Join(ids, ", "), why)
}

// WithVerifyKeys makes the repository's Resolve accept only a manifest
// signed by one of keys (VerifySignature): what a restore resolves is
// refused before a byte of it is read. It may be given more than once.
func WithVerifyKeys(keys ...VerifyKey) Option {
	return func(o *openOptions) { o.verify = append(o.verify, keys...) }
}

// verifying is a Repository whose Resolve verifies the signature of what
// it resolved.
type verifying struct {
	Repository
	keys []VerifyKey
}

// Unwrap returns the repository underneath.
func (v *verifying) Unwrap() Repository { return v.Repository }

func (v *verifying) Resolve(ctx context.Context) (ocispec.Descriptor, error) {
	desc, err := v.Repository.Resolve(ctx)
	if err != nil {
		return desc, err
	}
	return desc, VerifySignature(ctx, v.Repository, desc, v.keys)
}

// PinVerified, for a repository that verifies signatures (WithVerifyKeys),
// resolves its reference now, which verifies the manifest's signature, and
// returns the repository pinned to that manifest (Pinned), so that every
// later read is of the manifest verified, even if a tag moves meanwhile.
// Any other repository is returned as it is, without a request.
func PinVerified(ctx context.Context, repo Repository) (Repository, error) {
	if !Verifying(repo) {
		return repo, nil
	}
	desc, err := repo.Resolve(ctx)
	if err != nil {
		return nil, err
	}
	return Pinned(repo, desc), nil
}

// Verifying reports whether repo's Resolve verifies signatures.
func Verifying(repo Repository) bool {
	for {
		if _, ok := repo.(*verifying); ok {
			return true
		}
		u, ok := repo.(Unwrapper)
		if !ok {
			return false
		}
		repo = u.Unwrap()
	}
}
