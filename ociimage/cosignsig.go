package ociimage

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/sigstore/sigstore/pkg/signature/payload"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Cosign's signature format, shared by Sign and VerifySignature: where the
// signatures of a manifest are (its tag), what a signature's payload
// says, and the manifest that lists them.

// SignatureTag is the tag under which cosign keeps the signatures of the
// manifest d names, in the same repository: sha256-HEX.sig.
func SignatureTag(d digest.Digest) string {
	return string(d.Algorithm()) + "-" + d.Encoded() + ".sig"
}

// signaturePayload is the simple signing payload cosign signs for the
// manifest d in the repository ref: the digest, and the repository as
// identity (HOST/REPO, as cosign writes it). A layout has no repository
// name: its payload names none.
func signaturePayload(ref Reference, d digest.Digest) ([]byte, error) {
	var p payload.SimpleContainerImage
	p.Critical.Type = payload.CosignSignatureType
	p.Critical.Image.DockerManifestDigest = d.String()
	if !ref.IsLayout() {
		p.Critical.Identity.DockerReference = ref.Registry + "/" + ref.Repository
	}
	return json.Marshal(p)
}

// checkPayload checks the claims of a payload whose signature verified:
// its type, that it names the manifest d, and, for a registry, that it
// names ref's repository. The registry host is not compared, so that a
// checkpoint copied to another registry under the same repository path
// verifies there; a copy under another path must be signed again.
func checkPayload(b []byte, ref Reference, d digest.Digest) error {
	var p payload.SimpleContainerImage
	if err := json.Unmarshal(b, &p); err != nil {
		return errors.New("its payload is not a simple signing payload")
	}
	switch {
	case p.Critical.Type != payload.CosignSignatureType:
		return errors.New("its payload is not a cosign container image signature")
	case p.Critical.Image.DockerManifestDigest != d.String():
		return errors.New("it signs the manifest " + clip(p.Critical.Image.DockerManifestDigest) + ", not " + d.String())
	case ref.IsLayout():
		return nil
	}
	claimed, err := ParseReference(p.Critical.Identity.DockerReference)
	if err != nil || claimed.IsLayout() || claimed.Repository != ref.Repository {
		return errors.New("it was made for the repository " + clip(p.Critical.Identity.DockerReference) + ", not " + ref.Repository +
			" (a copy under another repository path must be signed again there)")
	}
	return nil
}

// signatureManifest is the manifest that lists layers as signatures, with
// the config cosign writes (an empty image's, each layer its own diff ID),
// returned with the config's bytes.
func signatureManifest(layers []ocispec.Descriptor) (ocispec.Manifest, []byte, error) {
	cfg := v1.ConfigFile{RootFS: v1.RootFS{Type: "layers"}, History: []v1.History{{}}}
	for _, l := range layers {
		h, err := v1.NewHash(l.Digest.String())
		if err != nil {
			return ocispec.Manifest{}, nil, errcode.Wrap(errcode.InvalidInput, err, "signature layer %s", l.Digest)
		}
		cfg.RootFS.DiffIDs = append(cfg.RootFS.DiffIDs, h)
	}
	b, err := json.Marshal(cfg)
	if err != nil {
		return ocispec.Manifest{}, nil, errcode.Wrap(errcode.Internal, err, "encoding a signature config")
	}
	return ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest,
		Config:    ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: digest.FromBytes(b), Size: int64(len(b))},
		Layers:    layers,
	}, b, nil
}

// fetchSignatures reads the signature manifest of the manifest d from
// store, bounded (MaxSignatureManifestSize, MaxSignatureLayers) before
// and after it is fetched. found is false when there is none.
func fetchSignatures(ctx context.Context, store Repository, d digest.Digest) (m ocispec.Manifest, found bool, err error) {
	tag := SignatureTag(d)
	_, m, err = fetchAtTag(ctx, store, tag, MaxSignatureManifestSize)
	if errors.Is(err, ErrNotFound) {
		return m, false, nil
	}
	if err != nil {
		return m, true, err
	}
	if len(m.Layers) > MaxSignatureLayers {
		return m, true, errcode.New(errcode.InvalidInput, "its signature manifest %s lists %d signatures, more than the %d vmsnap reads", tag, len(m.Layers), MaxSignatureLayers)
	}
	return m, true, nil
}

// clip shortens what a registry wrote for a message.
func clip(s string) string {
	if len(s) > 100 {
		s = s[:100] + "..."
	}
	return string(bytes.ToValidUTF8([]byte(s), []byte("?")))
}
