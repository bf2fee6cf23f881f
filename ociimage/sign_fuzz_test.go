package ociimage

import (
	"context"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/keys"
)

// FuzzVerifySignature: whatever a signature layer holds (its media type,
// its signature annotation, its payload), VerifySignature never panics,
// and it accepts only the payload and signature the key made; every
// refusal is AUTH_FAILED.
func FuzzVerifySignature(f *testing.F) {
	f.Add("application/vnd.dev.cosign.simplesigning.v1+json", "", []byte(`{"critical":{"identity":{"docker-reference":""},"image":{"docker-manifest-digest":"sha256:00"},"type":"cosign container image signature"},"optional":null}`))
	f.Add(MediaTypeSimpleSigning, "MEUCIQ==", []byte(`{}`))
	f.Add(MediaTypeSimpleSigning, "!!!", []byte(`null`))
	f.Add("", "AAAA", []byte{})
	// One image for every input, each storing its own signature over it.
	dir := f.TempDir()
	var fx *fuzzFixture
	f.Fuzz(func(t *testing.T, mediaType, sig string, payload []byte) {
		if len(payload) > 1<<16 {
			return
		}
		if fx == nil {
			fx = fuzzSignFixture(t, dir)
		}
		f := fx
		ctx := context.Background()
		layer := ocispec.Descriptor{MediaType: mediaType, Digest: blobDesc("", payload).Digest, Size: int64(len(payload)),
			Annotations: map[string]string{AnnotationCosignSignature: sig}}
		if err := f.repo.PutBlob(ctx, layer, payload); err != nil {
			t.Fatal(err)
		}
		m, cfg, err := signatureManifest([]ocispec.Descriptor{layer})
		if err != nil {
			t.Fatal(err)
		}
		putBlob(t, f.repo, m.Config.MediaType, cfg)
		if _, err := putAtTag(ctx, f.repo, m, SignatureTag(f.desc.Digest)); err != nil {
			t.Fatal(err)
		}
		err = VerifySignature(ctx, f.repo, f.desc, []VerifyKey{f.pub})
		if err == nil {
			t.Fatalf("accepted a signature layer the key did not make: %q %q %q", mediaType, sig, payload)
		}
		if errcode.Of(err) != errcode.AuthFailed {
			t.Fatalf("refused with %v (%s), want AUTH_FAILED", err, errcode.Of(err))
		}
	})
}

type fuzzFixture struct {
	repo Repository
	desc ocispec.Descriptor
	pub  VerifyKey
}

// fuzzSignFixture is an image in a layout in dir and a key that did not
// sign it.
func fuzzSignFixture(t *testing.T, dir string) *fuzzFixture {
	t.Helper()
	_, pub := keys.PEMPair(t, dir, "k", true)
	vk, err := LoadVerifyKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	repo := openLayoutWith(t, "oci:"+dir+"/store")
	return &fuzzFixture{repo: repo, desc: pushSigned(t, repo, "fuzzed"), pub: vk}
}
