package agent

// Which signatures the agent requires of the images it restores.
//
// An image a restore or prepare request names must carry a cosign
// signature (ociimage.VerifySignature) by one of the keys that apply to
// it: every --verify-key, for every image, and the key of every
// --require-signature HOST[:PORT]/PREFIX=KEY whose prefix covers its
// repository, with the rules of --allow-repository (policy.go), a
// {namespace} placeholder matching any namespace whoever asks. No key applying: no signature needed.
// The signature is checked before anything else of the image is read;
// an image without one is AUTH_FAILED.

import (
	"context"
	"strings"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// signaturePolicy is the agent's --verify-key and --require-signature.
type signaturePolicy struct {
	all      []ociimage.VerifyKey
	prefixed []prefixKey
}

// prefixKey is one --require-signature entry.
type prefixKey struct {
	prefix repoPrefix
	key    ociimage.VerifyKey
}

// newSignaturePolicy reads every --require-signature entry's key file.
func newSignaturePolicy(all []ociimage.VerifyKey, required []string) (*signaturePolicy, error) {
	p := &signaturePolicy{all: all}
	for _, s := range required {
		prefix, file, ok := strings.Cut(s, "=")
		if !ok || file == "" {
			return nil, errcode.New(errcode.Usage, "--require-signature %q: want HOST[:PORT]/PREFIX=KEY, KEY a PEM public key file (cosign.pub)", s)
		}
		rp, err := parseRepoPrefix(prefix)
		if err != nil {
			return nil, errcode.Wrap(errcode.Usage, err, "--require-signature %q", s)
		}
		k, err := ociimage.LoadVerifyKey(file)
		if err != nil {
			return nil, err
		}
		p.prefixed = append(p.prefixed, prefixKey{prefix: rp, key: k})
	}
	return p, nil
}

// keysFor are the keys that apply to the image reference s. A
// requirement belongs to the repository, not to the caller: {namespace}
// in it matches any namespace, as it does for an admin caller, so a
// caller of one namespace reading another's repository (under a broader
// --allow-repository) needs that repository's signature too.
func (p *signaturePolicy) keysFor(_ Caller, s string) ([]ociimage.VerifyKey, error) {
	ref, err := ociimage.ParseReference(s)
	if err != nil {
		return nil, err
	}
	keys := append([]ociimage.VerifyKey(nil), p.all...)
	for _, e := range p.prefixed {
		if e.prefix.covers(ref, Caller{Admin: true}) {
			keys = append(keys, e.key)
		}
	}
	return keys, nil
}

// readStore is the store options for reading image on behalf of the
// request's caller, whose namespace is ns: its keys (storeFor) and the
// signatures the image must carry.
func (s *Server) readStore(ctx context.Context, ns, image string) ([]ociimage.Option, error) {
	c, err := requestCaller(ctx)
	if err != nil {
		return nil, err
	}
	keys, err := s.signatures.keysFor(c, image)
	if err != nil {
		return nil, err
	}
	opts, err := s.storeFor(ctx, ns)
	if err != nil || len(keys) == 0 {
		return opts, err
	}
	return append(opts, ociimage.WithVerifyKeys(keys...)), nil
}
