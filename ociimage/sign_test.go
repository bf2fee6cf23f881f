package ociimage

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/keys"
)

// signFixture is a signing key and its public key, plus a second key pair
// whose signatures must not count.
type signFixture struct {
	key         SignKey
	pub, other  VerifyKey
	otherSigner SignKey
}

func newSignFixture(t *testing.T) signFixture {
	t.Helper()
	dir := t.TempDir()
	priv, pub := keys.PEMPair(t, dir, "signer", true)
	opriv, opub := keys.PEMPair(t, dir, "other", true)
	var f signFixture
	var err error
	if f.key, err = LoadSignKey(priv, nil); err != nil {
		t.Fatal(err)
	}
	if f.otherSigner, err = LoadSignKey(opriv, nil); err != nil {
		t.Fatal(err)
	}
	if f.pub, err = LoadVerifyKey(pub); err != nil {
		t.Fatal(err)
	}
	if f.other, err = LoadVerifyKey(opub); err != nil {
		t.Fatal(err)
	}
	return f
}

// pushSigned stores an image through a repository opened with opts (a
// signer among them) and returns its manifest's descriptor.
func pushSigned(t *testing.T, repo Repository, note string) ocispec.Descriptor {
	t.Helper()
	desc, err := repo.PutManifest(t.Context(), testManifest(t, repo, note, "chunk of "+note))
	if err != nil {
		t.Fatal(err)
	}
	return desc
}

// signatureLayers reads the signature manifest of d as stored.
func signatureLayers(t *testing.T, repo Repository, desc ocispec.Descriptor) (ocispec.Descriptor, ocispec.Manifest) {
	t.Helper()
	store := Underlying(repo)
	sd, err := store.ResolveTag(t.Context(), SignatureTag(desc.Digest))
	if err != nil {
		t.Fatal(err)
	}
	m, err := store.Manifest(t.Context(), sd)
	if err != nil {
		t.Fatal(err)
	}
	return sd, m
}

// The signature is where and what cosign writes: a manifest tagged
// sha256-HEX.sig, an OCI image config, one simple signing layer whose
// payload names the digest and the repository, its signature in the
// annotation; and it verifies, in a layout and in a registry.
func TestSignWritesCosignsFormat(t *testing.T) {
	f := newSignFixture(t)
	reg := newFakeRegistry(t)
	for name, repo := range map[string]Repository{
		"layout":   openLayoutWith(t, "oci:"+t.TempDir(), WithSigner(f.key)),
		"registry": reg.open(t, "vms/web", WithSigner(f.key)),
	} {
		desc := pushSigned(t, repo, name)
		if tag := SignatureTag(desc.Digest); tag != "sha256-"+desc.Digest.Encoded()+".sig" {
			t.Fatalf("%s: signature tag %s", name, tag)
		}
		_, m := signatureLayers(t, repo, desc)
		if m.Config.MediaType != ocispec.MediaTypeImageConfig || len(m.Layers) != 1 {
			t.Fatalf("%s: signature manifest %+v", name, m)
		}
		l := m.Layers[0]
		if l.MediaType != MediaTypeSimpleSigning || l.Annotations[AnnotationCosignSignature] == "" {
			t.Fatalf("%s: signature layer %+v", name, l)
		}
		p, err := Underlying(repo).Blob(t.Context(), l, MaxSignaturePayloadSize)
		if err != nil {
			t.Fatal(err)
		}
		want := `{"critical":{"identity":{"docker-reference":"` + reg.host + `/vms/web"},"image":{"docker-manifest-digest":"` +
			desc.Digest.String() + `"},"type":"cosign container image signature"},"optional":null}`
		if name == "layout" {
			want = strings.Replace(want, reg.host+"/vms/web", "", 1)
		}
		if string(p) != want {
			t.Fatalf("%s: payload\n%s\nwant\n%s", name, p, want)
		}
		var cfg struct {
			RootFS struct {
				Type    string   `json:"type"`
				DiffIDs []string `json:"diff_ids"`
			} `json:"rootfs"`
		}
		b, err := Underlying(repo).Blob(t.Context(), m.Config, MaxConfigSize)
		if err != nil || json.Unmarshal(b, &cfg) != nil || cfg.RootFS.Type != "layers" ||
			len(cfg.RootFS.DiffIDs) != 1 || cfg.RootFS.DiffIDs[0] != l.Digest.String() {
			t.Fatalf("%s: signature config %s (%v)", name, b, err)
		}
		if err := VerifySignature(t.Context(), repo, desc, []VerifyKey{f.other, f.pub}); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
}

func openLayoutWith(t *testing.T, ref string, opts ...Option) Repository {
	t.Helper()
	r, err := ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	repo, err := Open(t.Context(), r, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return repo
}

// A second signature is added beside the first, as cosign adds one: both
// keys verify.
func TestSignAppendsToExistingSignatures(t *testing.T) {
	f := newSignFixture(t)
	repo := openLayoutWith(t, "oci:"+t.TempDir(), WithSigner(f.key))
	desc := pushSigned(t, repo, "a")
	if err := Sign(t.Context(), repo, desc, f.otherSigner); err != nil {
		t.Fatal(err)
	}
	if _, m := signatureLayers(t, repo, desc); len(m.Layers) != 2 {
		t.Fatalf("%d signature layers after two signatures, want 2", len(m.Layers))
	}
	for _, k := range []VerifyKey{f.pub, f.other} {
		if err := VerifySignature(t.Context(), repo, desc, []VerifyKey{k}); err != nil {
			t.Fatalf("key %s: %v", k.ID, err)
		}
	}
}

// Each attack on a signature is refused with AUTH_FAILED and a message
// that says what was wrong: an unsigned image, a signature by another key,
// a tampered signature, a tampered payload, another digest's signature
// replayed under this digest's tag, and another repository's.
func TestVerifySignatureRefusals(t *testing.T) {
	f := newSignFixture(t)
	reg := newFakeRegistry(t)
	ctx := t.Context()
	keys := []VerifyKey{f.pub}
	signed := reg.open(t, "vms/web", WithSigner(f.key))
	plain := reg.open(t, "vms/web")

	unsigned := pushSigned(t, plain, "unsigned")
	wantCode(t, VerifySignature(ctx, plain, unsigned, keys), errcode.AuthFailed, "has no signature")

	byOther := pushSigned(t, reg.open(t, "vms/web", WithSigner(f.otherSigner)), "other key")
	wantCode(t, VerifySignature(ctx, plain, byOther, keys), errcode.AuthFailed, "not made by any of the keys given")

	tampered := pushSigned(t, signed, "tampered")
	rewriteSignatures(t, plain, tampered, func(l *ocispec.Descriptor) {
		sig, _ := base64.StdEncoding.DecodeString(l.Annotations[AnnotationCosignSignature])
		sig[len(sig)/2] ^= 1
		l.Annotations[AnnotationCosignSignature] = base64.StdEncoding.EncodeToString(sig)
	})
	wantCode(t, VerifySignature(ctx, plain, tampered, keys), errcode.AuthFailed, "not made by any of the keys given")

	// Another payload under the same signature: this digest's payload,
	// stored as a blob, listed with the signature of another digest's.
	other := pushSigned(t, signed, "payload source")
	_, om := signatureLayers(t, plain, other)
	swapped := pushSigned(t, signed, "swapped payload")
	rewriteSignatures(t, plain, swapped, func(l *ocispec.Descriptor) {
		l.Annotations[AnnotationCosignSignature] = om.Layers[0].Annotations[AnnotationCosignSignature]
	})
	wantCode(t, VerifySignature(ctx, plain, swapped, keys), errcode.AuthFailed, "not made by any of the keys given")

	// Replay: the valid signature manifest of another image, tagged as
	// this one's.
	victim := pushSigned(t, plain, "victim")
	sd, _ := signatureLayers(t, plain, other)
	if err := plain.TagManifest(ctx, sd, SignatureTag(victim.Digest)); err != nil {
		t.Fatal(err)
	}
	wantCode(t, VerifySignature(ctx, plain, victim, keys), errcode.AuthFailed, "it signs the manifest "+other.Digest.String())

	// Another repository's valid signature, copied here with its image.
	elsewhere := reg.open(t, "vms/other", WithSigner(f.key))
	moved := pushSigned(t, elsewhere, "moved")
	copySigned(t, elsewhere, plain, moved)
	wantCode(t, VerifySignature(ctx, plain, moved, keys), errcode.AuthFailed, "made for the repository "+reg.host+"/vms/other")
}

// rewriteSignatures changes d's signature layers with edit and stores the
// result at d's signature tag, as someone who may push would.
func rewriteSignatures(t *testing.T, repo Repository, d ocispec.Descriptor, edit func(*ocispec.Descriptor)) {
	t.Helper()
	_, m := signatureLayers(t, repo, d)
	for i := range m.Layers {
		edit(&m.Layers[i])
	}
	putSignatureManifest(t, repo, d, m.Layers)
}

func putSignatureManifest(t *testing.T, repo Repository, d ocispec.Descriptor, layers []ocispec.Descriptor) {
	t.Helper()
	m, cfg, err := signatureManifest(layers)
	if err != nil {
		t.Fatal(err)
	}
	putBlob(t, repo, m.Config.MediaType, cfg)
	sd, err := repo.PutManifest(t.Context(), m)
	if err != nil {
		t.Fatal(err)
	}
	if err := repo.TagManifest(t.Context(), sd, SignatureTag(d.Digest)); err != nil {
		t.Fatal(err)
	}
}

// copySigned copies d's manifest and its signatures from src to dst.
func copySigned(t *testing.T, src, dst Repository, d ocispec.Descriptor) {
	t.Helper()
	if _, err := Copy(t.Context(), Pinned(src, d), dst, 0, 2); err != nil {
		t.Fatal(err)
	}
	sd, _ := signatureLayers(t, src, d)
	if _, err := Copy(t.Context(), Pinned(src, sd), dst, 0, 2); err != nil {
		t.Fatal(err)
	}
	if err := dst.TagManifest(t.Context(), sd, SignatureTag(d.Digest)); err != nil {
		t.Fatal(err)
	}
}

// A signature copied with its image to another registry, under the same
// repository path, still verifies there: the host is not part of what is
// checked.
func TestVerifySignatureAfterCopyToAnotherRegistry(t *testing.T) {
	f := newSignFixture(t)
	src, dst := newFakeRegistry(t), newFakeRegistry(t)
	from := src.open(t, "vms/web", WithSigner(f.key))
	d := pushSigned(t, from, "relocated")
	to := dst.open(t, "vms/web")
	copySigned(t, from, to, d)
	if err := VerifySignature(t.Context(), to, d, []VerifyKey{f.pub}); err != nil {
		t.Fatal(err)
	}
}

// Signature manifests and payloads are bounded before they are read: one
// said to be too large is refused without being fetched, and so is one
// listing too many signatures or a payload too large.
func TestVerifySignatureBounds(t *testing.T) {
	f := newSignFixture(t)
	reg := newFakeRegistry(t)
	ctx := t.Context()
	repo := reg.open(t, "vms/web")
	keys := []VerifyKey{f.pub}

	big := pushSigned(t, repo, "oversized manifest")
	layers := make([]ocispec.Descriptor, 0, 3000)
	for range 3000 {
		layers = append(layers, putBlob(t, repo, MediaTypeSimpleSigning, []byte(`{}`)))
	}
	for i := range layers {
		layers[i].Annotations = map[string]string{AnnotationCosignSignature: strings.Repeat("A", 200)}
	}
	putSignatureManifest(t, repo, big, layers)
	wantCode(t, VerifySignature(ctx, repo, big, keys), errcode.AuthFailed, "more than the 524288 vmsnap reads")

	// The same without a length: the registry streams on, vmsnap stops
	// reading past the bound.
	endless := pushSigned(t, repo, "endless manifest")
	var written atomic.Int64
	reg.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if !strings.HasSuffix(r.URL.Path, "/manifests/"+SignatureTag(endless.Digest)) {
			return false
		}
		w.Header().Set("Content-Type", ocispec.MediaTypeImageManifest)
		w.WriteHeader(http.StatusOK)
		buf := bytes.Repeat([]byte(" "), 64<<10)
		for range 1024 { // 64 MiB
			n, err := w.Write(buf)
			written.Add(int64(n))
			if err != nil {
				return true
			}
		}
		return true
	})
	wantCode(t, VerifySignature(ctx, repo, endless, keys), errcode.AuthFailed, "more than the 524288 vmsnap reads")
	reg.setIntercept(nil)
	if n := written.Load(); n > 16<<20 {
		t.Fatalf("the registry got %d bytes of an endless signature manifest out", n)
	}

	many := pushSigned(t, repo, "too many signatures")
	putSignatureManifest(t, repo, many, layers[:MaxSignatureLayers+1])
	wantCode(t, VerifySignature(ctx, repo, many, keys), errcode.AuthFailed, "1001 signatures, more than the 1000")

	fat := pushSigned(t, repo, "oversized payload")
	payload := putBlob(t, repo, MediaTypeSimpleSigning, make([]byte, MaxSignaturePayloadSize+1))
	payload.Annotations = map[string]string{AnnotationCosignSignature: "AAAA"}
	putSignatureManifest(t, repo, fat, []ocispec.Descriptor{payload})
	reg.resetLog()
	wantCode(t, VerifySignature(ctx, repo, fat, keys), errcode.AuthFailed, "more than the 65536 vmsnap reads")
	if n := reg.count("GET", "/blobs/"+payload.Digest.String()); n != 0 {
		t.Fatalf("the oversized payload was fetched")
	}
}

// A repository opened with verification keys verifies what it resolves,
// and PinVerified keeps reading the manifest it verified when the tag
// moves to an unsigned one meanwhile.
func TestPinVerified(t *testing.T) {
	f := newSignFixture(t)
	dir := t.TempDir()
	signed := openLayoutWith(t, "oci:"+dir, WithSigner(f.key))
	good := pushSigned(t, signed, "good")
	if err := signed.TagManifest(t.Context(), good, "v1"); err != nil {
		t.Fatal(err)
	}
	repo := openLayoutWith(t, "oci:"+dir+":v1", WithVerifyKeys(f.pub))
	pinned, err := PinVerified(t.Context(), repo)
	if err != nil {
		t.Fatal(err)
	}
	plain := openLayoutWith(t, "oci:"+dir)
	bad := pushSigned(t, plain, "bad")
	if err := plain.TagManifest(t.Context(), bad, "v1"); err != nil {
		t.Fatal(err)
	}
	if d, err := pinned.Resolve(t.Context()); err != nil || d.Digest != good.Digest {
		t.Fatalf("pinned resolves %v, %v; want the verified %s", d.Digest, err, good.Digest)
	}
	_, err = repo.Resolve(t.Context())
	wantCode(t, err, errcode.AuthFailed, "has no signature")
	if r, err := PinVerified(t.Context(), plain); err != nil || r != plain {
		t.Fatalf("PinVerified of a repository that does not verify: %v, %v", r, err)
	}
}
