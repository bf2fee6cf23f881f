package imgcrypt

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// A private-key operation (an RSA-OAEP unwrap) costs about a millisecond
// (4096-bit keys: several), and a JWE may list any number of recipients:
// an image in a tenant's own repository whose one encrypted layer lists
// thousands of recipients, each naming the namespace's key (its ID is in
// every checkpoint of the namespace) with an encrypted_key of random bytes,
// made the agent try every one, for every key of the namespace, in a loop
// no deadline stops: minutes of both cores per manifest read, an
// operation slot held past --operation-timeout. What a Decrypt repository
// unwraps is bounded, and a recipient that names another key is never
// tried with this one.
func TestDecryptBoundsPrivateKeyOperations(t *testing.T) {
	f := newEncFixture(t, 2) // RSA, EC: two recipients, JWE's general form
	dir := t.TempDir()
	enc, _ := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}, WithEncryption(EncryptOptions{Recipients: f.rcpt}))
	desc, _, _ := pushEncrypted(t, enc, randomChunks(1, 3000))
	raw := openLayout(t, "oci:"+dir)
	m, err := raw.Manifest(t.Context(), desc)
	if err != nil {
		t.Fatal(err)
	}
	var j jweJSON
	if err := json.Unmarshal(jweOf(t, m.Layers[0]), &j); err != nil || len(j.Recipients) != 2 {
		t.Fatalf("the layer's JWE: %v, %d recipients; want 2", err, len(j.Recipients))
	}
	const forged = 3000
	j.Recipients = nil
	for i := range forged {
		ek := make([]byte, 256)
		rand.Read(ek)
		kid := f.rcpt[0].ID
		if i%2 == 1 {
			kid = f.rcpt[1].ID // the other key's: never tried with the RSA key
		}
		j.Recipients = append(j.Recipients, jweRecipient{Header: map[string]any{"alg": "RSA-OAEP", "kid": kid}, EncryptedKey: base64.RawURLEncoding.EncodeToString(ek)})
	}
	jwe, err := json.Marshal(j)
	if err != nil {
		t.Fatal(err)
	}
	l := m.Layers[0]
	l.Annotations = map[string]string{}
	for k, v := range m.Layers[0].Annotations {
		l.Annotations[k] = v
	}
	l.Annotations[ociimage.AnnotationEncKeysJWE] = base64.StdEncoding.EncodeToString(jwe)
	m.Layers = []ocispec.Descriptor{l}
	desc, err = raw.PutManifest(t.Context(), m)
	if err != nil {
		t.Fatal(err)
	}

	dec := Decrypt(raw, f.priv[:1]).(*decrypting)
	start := time.Now()
	_, err = dec.Manifest(t.Context(), desc)
	took := time.Since(start)
	if err == nil {
		t.Fatal("a layer whose JWE lists only forged recipients was opened")
	}
	if n, most := len(dec.unwrapped.m), baseUnwraps+unwrapsPerLayer; n > most {
		t.Fatalf("reading a manifest of one encrypted layer made %d private-key operations (%v), more than the %d a Decrypt repository may make for it", n, took, most)
	}
	if errcode.Of(err) != errcode.InvalidInput {
		t.Fatalf("got %v (code %s), want INVALID_INPUT saying the image asks for too many unwraps", err, errcode.Of(err))
	}
	t.Logf("%d private-key operations, %v: %v", len(dec.unwrapped.m), took, err)
}

// The bound grows with the layers read: an image another writer encrypted
// with a key of its own per layer (ocicrypt's way; here, each layer sealed
// under its own CEK) needs an unwrap per layer, more than the base budget.
func TestDecryptReadsAnImageWithAKeyPerLayer(t *testing.T) {
	f := newEncFixture(t, 2) // an EC key: the cheaper unwrap
	dir := t.TempDir()
	repo, err := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}, WithEncryption(EncryptOptions{Recipients: f.rcpt[1:]}))
	if err != nil {
		t.Fatal(err)
	}
	enc := repo.(*encrypting)
	const n = baseUnwraps + 100
	var layers []ocispec.Descriptor
	for _, c := range randomChunks(n, 64) {
		enc.seal.mu.Lock()
		enc.seal.cur = nil // a CEK of its own
		enc.seal.mu.Unlock()
		d := ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk, Digest: digest.FromBytes(c), Size: int64(len(c)), Annotations: map[string]string{ociimage.AnnotationRawSize: "1"}}
		if _, err := addBlob(t.Context(), enc, d, c); err != nil {
			t.Fatal(err)
		}
		layers = append(layers, d)
	}
	desc, err := ociimage.PushArtifact(t.Context(), enc, ociimage.Artifact{ArtifactType: ociimage.ArtifactTypeVMState, ConfigMediaType: ociimage.MediaTypeVMStateConfig, Config: testConfig{Machine: "pc", Memory: 1}, Layers: layers})
	if err != nil {
		t.Fatal(err)
	}
	dec := Decrypt(openLayout(t, "oci:"+dir), f.priv[1:]).(*decrypting)
	if _, err := dec.Manifest(t.Context(), desc); err != nil {
		t.Fatalf("an image of %d layers, each under its own key: %v", n, err)
	}
	if got := len(dec.unwrapped.m); got != n {
		t.Fatalf("%d private-key operations for %d layers under keys of their own, want one each", got, n)
	}
}
