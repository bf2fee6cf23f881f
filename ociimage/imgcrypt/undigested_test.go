package imgcrypt

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/ociimage"
)

// The chunk pipeline's fast path (ociimage/chunk) asks its sink for this.
type undigestedAdder interface {
	AddUndigested(ctx context.Context, desc ocispec.Descriptor, data []byte) (ocispec.Descriptor, bool, error)
}

// AddUndigested, the encrypting store's one pass over a layer that hashes
// its plaintext beside its ciphertext, stores what AddBlob does: the
// returned descriptor has the plaintext's digest and size, a repeated
// layer is stored once, and every stored layer has its ciphertext's digest
// and HMAC, and decrypts with the recipient's key to the plaintext.
func TestEncryptUndigested(t *testing.T) {
	f := newEncFixture(t, 1)
	dir := t.TempDir()
	enc, err := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}, WithEncryption(EncryptOptions{Recipients: f.rcpt}))
	if err != nil {
		t.Fatal(err)
	}
	u, ok := enc.(undigestedAdder)
	if !ok {
		t.Fatalf("Open's encrypting repository (%T) has no AddUndigested: the chunk pipeline would digest every chunk twice", enc)
	}
	chunks := randomChunks(4, 300_001) // not a whole number of cipher or hash blocks
	chunks = append(chunks, chunks[1], []byte{})
	var layers []ocispec.Descriptor
	for i, c := range chunks {
		d, sent, err := u.AddUndigested(t.Context(), ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk, Annotations: map[string]string{ociimage.AnnotationRawSize: "1"}}, c)
		if err != nil {
			t.Fatal(err)
		}
		if d.Digest != digest.FromBytes(c) || d.Size != int64(len(c)) {
			t.Fatalf("chunk %d: descriptor %s, %d bytes; want %s, %d", i, d.Digest, d.Size, digest.FromBytes(c), len(c))
		}
		if sent != (i != 4) {
			t.Fatalf("chunk %d: sent %v (chunk 4 repeats chunk 1)", i, sent)
		}
		layers = append(layers, d)
	}
	desc, err := ociimage.PushArtifact(t.Context(), enc, ociimage.Artifact{
		ArtifactType: ociimage.ArtifactTypeVMState, ConfigMediaType: ociimage.MediaTypeVMStateConfig,
		Config: testConfig{Machine: "pc", Memory: 1}, Layers: layers,
	})
	if err != nil {
		t.Fatal(err)
	}
	raw := openLayout(t, "oci:"+dir)
	m, err := raw.Manifest(t.Context(), desc)
	if err != nil {
		t.Fatal(err)
	}
	for i, l := range m.Layers {
		ct, err := raw.Blob(t.Context(), l, ociimage.MaxChunkSize) // checks the ciphertext's digest
		if err != nil {
			t.Fatalf("layer %d: %v", i, err)
		}
		plain, k, err := decryptLayer(l, f.priv, newUnwrapCache())
		if err != nil || plain.Digest != layers[i].Digest {
			t.Fatalf("layer %d: unwrapped %+v, %v", i, plain, err)
		}
		var pub publicOpts
		pb, _ := base64.StdEncoding.DecodeString(l.Annotations[ociimage.AnnotationEncPubOpts])
		if err := json.Unmarshal(pb, &pub); err != nil {
			t.Fatal(err)
		}
		mac := hmac.New(sha256.New, k.key)
		mac.Write(ct)
		if !hmac.Equal(pub.Hmac, mac.Sum(nil)) {
			t.Fatalf("layer %d: its HMAC is not its ciphertext's", i)
		}
		k.xorAt(ct, ct, 0)
		if !bytes.Equal(ct, chunks[i]) {
			t.Fatalf("layer %d does not decrypt to its plaintext", i)
		}
	}
}

// With a dedup secret the key derives from the digest: AddUndigested
// digests first and stores the very blob AddBlob stores.
func TestEncryptUndigestedDedupSecret(t *testing.T) {
	f := newEncFixture(t, 1)
	c := randomChunks(1, 70_000)[0]
	stored := func(undigested bool) digest.Digest {
		dir := t.TempDir()
		enc, err := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}, WithEncryption(EncryptOptions{Recipients: f.rcpt, DedupSecret: []byte("a dedup secret of 32 bytes, no..")}))
		if err != nil {
			t.Fatal(err)
		}
		d := ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk, Digest: digest.FromBytes(c), Size: int64(len(c))}
		if undigested {
			d, _, err = enc.(undigestedAdder).AddUndigested(t.Context(), ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk}, c)
		} else {
			_, err = addBlob(t.Context(), enc, d, c)
		}
		if err != nil {
			t.Fatal(err)
		}
		desc, err := ociimage.PushArtifact(t.Context(), enc, ociimage.Artifact{
			ArtifactType: ociimage.ArtifactTypeVMState, ConfigMediaType: ociimage.MediaTypeVMStateConfig,
			Config: testConfig{Machine: "pc", Memory: 1}, Layers: []ocispec.Descriptor{d},
		})
		if err != nil {
			t.Fatal(err)
		}
		m, err := openLayout(t, "oci:"+dir).Manifest(t.Context(), desc)
		if err != nil {
			t.Fatal(err)
		}
		return m.Layers[0].Digest
	}
	if a, b := stored(false), stored(true); a != b {
		t.Fatalf("with a dedup secret, AddBlob stored %s and AddUndigested %s", a, b)
	}
}
