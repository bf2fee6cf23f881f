package imgcrypt

import (
	"bytes"
	"io"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/keys"
	"github.com/vmsnap/vmsnap/ociimage"
)

type encFixture struct {
	dir      string
	priv     []DecryptionKey
	rcpt     []Recipient
	privPath []string
}

func newEncFixture(t testing.TB, n int) encFixture {
	t.Helper()
	f := encFixture{dir: t.TempDir()}
	for i := range n {
		privPath, pubPath := keys.PEMPair(t, f.dir, "k"+string(rune('a'+i)), i%2 == 1)
		r, err := ParseRecipient("jwe:" + pubPath)
		if err != nil {
			t.Fatal(err)
		}
		k, err := LoadDecryptionKey(privPath)
		if err != nil {
			t.Fatal(err)
		}
		if k.ID != r.ID {
			t.Fatalf("key ID of the private key %s, of its public key %s", k.ID, r.ID)
		}
		f.rcpt, f.priv, f.privPath = append(f.rcpt, r), append(f.priv, k), append(f.privPath, privPath)
	}
	return f
}

func randomChunks(n, size int) [][]byte {
	var out [][]byte
	r := mrand.NewChaCha8([32]byte{1})
	for range n {
		b := make([]byte, size)
		r.Read(b)
		out = append(out, b)
	}
	return out
}

// pushEncrypted stores chunks through repo (which encrypts) as a VM state
// image and returns the manifest's descriptor and the plaintext layers.
func pushEncrypted(t *testing.T, repo ociimage.Repository, chunks [][]byte) (ocispec.Descriptor, []ocispec.Descriptor, int) {
	t.Helper()
	var layers []ocispec.Descriptor
	sent := 0
	for _, c := range chunks {
		d := ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk, Digest: digest.FromBytes(c), Size: int64(len(c)),
			Annotations: map[string]string{ociimage.AnnotationRawSize: "1"}}
		ok, err := addBlob(t.Context(), repo, d, c)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			sent++
		}
		layers = append(layers, d)
	}
	desc, err := ociimage.PushArtifact(t.Context(), repo, ociimage.Artifact{
		ArtifactType: ociimage.ArtifactTypeVMState, ConfigMediaType: ociimage.MediaTypeVMStateConfig,
		Config: testConfig{Machine: "pc", Memory: 1}, Layers: layers,
	})
	if err != nil {
		t.Fatal(err)
	}
	return desc, layers, sent
}

func TestEncryptRoundTrip(t *testing.T) {
	f := newEncFixture(t, 2) // an RSA and an EC recipient
	dir := t.TempDir()
	ref := ociimage.Reference{Layout: dir}
	enc, err := ociimage.Open(t.Context(), ref, WithEncryption(EncryptOptions{Recipients: f.rcpt}))
	if err != nil {
		t.Fatal(err)
	}
	chunks := randomChunks(5, 100_000)
	chunks = append(chunks, chunks[0]) // a repeated chunk: one blob
	desc, plainLayers, _ := pushEncrypted(t, enc, chunks)

	// What is stored: encrypted layers, the plaintext nowhere.
	plain := openLayout(t, "oci:"+dir)
	m, err := plain.Manifest(t.Context(), desc)
	if err != nil {
		t.Fatal(err)
	}
	if m.Config.MediaType != ociimage.MediaTypeVMStateConfig {
		t.Fatalf("config %+v: configs stay plaintext", m.Config)
	}
	for i, l := range m.Layers {
		if l.MediaType != ociimage.MediaTypeChunk+"+encrypted" || l.Digest == plainLayers[i].Digest || l.Size != plainLayers[i].Size ||
			l.Annotations[ociimage.AnnotationEncKeysJWE] == "" || l.Annotations[ociimage.AnnotationEncPubOpts] == "" || l.Annotations[ociimage.AnnotationRawSize] != "1" {
			t.Fatalf("stored layer %d: %+v", i, l)
		}
		if got := EncryptedFor(l); len(got) != 2 || !strings.Contains(strings.Join(got, " "), f.rcpt[0].ID) || !strings.Contains(strings.Join(got, " "), f.rcpt[1].ID) {
			t.Fatalf("layer %d is encrypted for %v, want %s and %s", i, got, f.rcpt[0].ID, f.rcpt[1].ID)
		}
		ct, err := plain.Blob(t.Context(), l, ociimage.MaxChunkSize)
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Contains(ct, chunks[i][:64]) {
			t.Fatalf("layer %d's blob holds its plaintext", i)
		}
	}
	if m.Layers[0].Digest != m.Layers[5].Digest {
		t.Fatalf("a repeated chunk was encrypted twice: %s, %s", m.Layers[0].Digest, m.Layers[5].Digest)
	}

	// Each recipient alone reads it back, byte for byte.
	for _, k := range f.priv {
		dec, err := ociimage.Open(t.Context(), ref.WithDigest(desc.Digest), WithDecryptionKeys(k))
		if err != nil {
			t.Fatal(err)
		}
		var cfg testConfig
		_, dm, err := ociimage.PullArtifact(t.Context(), dec, ociimage.ArtifactTypeVMState, &cfg)
		if err != nil {
			t.Fatal(err)
		}
		for i, l := range dm.Layers {
			if l.MediaType != ociimage.MediaTypeChunk || l.Digest != plainLayers[i].Digest || l.Annotations[ociimage.AnnotationRawSize] != "1" || len(l.Annotations) != 1 {
				t.Fatalf("decrypted layer %d: %+v, want %+v", i, l, plainLayers[i])
			}
			b, err := dec.Blob(t.Context(), l, ociimage.MaxChunkSize)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(b, chunks[i]) {
				t.Fatalf("layer %d decrypts to other bytes", i)
			}
		}
	}
}

func TestDecryptWrongAndMissingKey(t *testing.T) {
	f := newEncFixture(t, 2)
	dir := t.TempDir()
	enc, err := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}, WithEncryption(EncryptOptions{Recipients: f.rcpt[:1]}))
	if err != nil {
		t.Fatal(err)
	}
	desc, _, _ := pushEncrypted(t, enc, randomChunks(2, 1000))
	ref := ociimage.Reference{Layout: dir}.WithDigest(desc.Digest)

	// Missing: no key given at all. The config is readable (inspect);
	// the layers are refused before any is fetched.
	repo, _ := ociimage.Open(t.Context(), ref)
	var cfg testConfig
	_, m, err := ociimage.PullArtifact(t.Context(), repo, ociimage.ArtifactTypeVMState, &cfg)
	if err != nil || cfg.Machine != "pc" {
		t.Fatalf("reading the config of an encrypted image without a key: %v", err)
	}
	err = CheckDecrypted(m.Layers)
	wantCode(t, err, errcode.AuthFailed, "encrypted")
	if !strings.Contains(err.Error(), f.rcpt[0].ID) || !strings.Contains(err.Error(), "no decryption key was given") {
		t.Fatalf("error %q should name the recipient %s", err, f.rcpt[0].ID)
	}

	// Wrong: the other key.
	repo, _ = ociimage.Open(t.Context(), ref, WithDecryptionKeys(f.priv[1]))
	_, _, err = ociimage.PullArtifact(t.Context(), repo, ociimage.ArtifactTypeVMState, &cfg)
	wantCode(t, err, errcode.AuthFailed, f.rcpt[0].ID)
	if !strings.Contains(err.Error(), f.priv[1].ID) {
		t.Fatalf("error %q should name the key given, %s", err, f.priv[1].ID)
	}
	noKeyMaterial(t, err.Error(), f)
}

// noKeyMaterial fails if s holds a line of any of f's private key files.
func noKeyMaterial(t *testing.T, s string, f encFixture) {
	t.Helper()
	for _, p := range f.privPath {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			if len(line) > 20 && strings.Contains(s, line) {
				t.Fatalf("%q holds a line of the private key %s", s, p)
			}
		}
	}
}

func TestDecryptTampered(t *testing.T) {
	f := newEncFixture(t, 1)
	dir := t.TempDir()
	enc, _ := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}, WithEncryption(EncryptOptions{Recipients: f.rcpt}))
	desc, _, _ := pushEncrypted(t, enc, randomChunks(1, 4096))
	stored, err := openLayout(t, "oci:"+dir).Manifest(t.Context(), desc)
	if err != nil {
		t.Fatal(err)
	}
	blob := filepath.Join(dir, "blobs", "sha256", stored.Layers[0].Digest.Encoded())
	b, _ := os.ReadFile(blob)
	b[100] ^= 1
	if err := os.WriteFile(blob, b, 0o644); err != nil {
		t.Fatal(err)
	}
	dec, _ := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}.WithDigest(desc.Digest), WithDecryptionKeys(f.priv...))
	var cfg testConfig
	_, m, err := ociimage.PullArtifact(t.Context(), dec, ociimage.ArtifactTypeVMState, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	got, err := dec.Blob(t.Context(), m.Layers[0], ociimage.MaxChunkSize)
	wantCode(t, err, errcode.DigestMismatch, "")
	if got != nil {
		t.Fatal("a tampered layer returned bytes")
	}
}

// A ciphertext altered and stored under its new digest, in a manifest
// rewritten to name it (what a registry writer without the key can do to
// an image restored by tag): the HMAC would catch it, and so does the
// plaintext digest wrapped with the key, which restore checks instead.
func TestDecryptRewrittenCiphertext(t *testing.T) {
	f := newEncFixture(t, 1)
	dir := t.TempDir()
	enc, _ := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}, WithEncryption(EncryptOptions{Recipients: f.rcpt}))
	desc, _, _ := pushEncrypted(t, enc, randomChunks(1, 4096))
	raw := openLayout(t, "oci:"+dir)
	m, err := raw.Manifest(t.Context(), desc)
	if err != nil {
		t.Fatal(err)
	}
	ct, err := raw.Blob(t.Context(), m.Layers[0], ociimage.MaxChunkSize)
	if err != nil {
		t.Fatal(err)
	}
	ct[10] ^= 0x80
	m.Layers[0].Digest = digest.FromBytes(ct)
	if err := raw.PutBlob(t.Context(), m.Layers[0], ct); err != nil {
		t.Fatal(err)
	}
	forged, err := raw.PutManifest(t.Context(), m)
	if err != nil {
		t.Fatal(err)
	}
	dec := Decrypt(raw, f.priv)
	dm, err := dec.Manifest(t.Context(), forged)
	if err != nil {
		t.Fatal(err)
	}
	got, err := dec.Blob(t.Context(), dm.Layers[0], ociimage.MaxChunkSize)
	wantCode(t, err, errcode.DigestMismatch, "decrypts to data that is not")
	if got != nil {
		t.Fatal("a forged layer returned bytes")
	}
}

func TestEncryptDedupSecret(t *testing.T) {
	f := newEncFixture(t, 1)
	chunks := randomChunks(8, 20_000)
	for _, tc := range []struct {
		name     string
		secret   []byte
		wantSent int
	}{
		{"random keys", nil, 8},
		{"dedup secret", bytes.Repeat([]byte{7}, 32), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			for round := range 2 {
				enc, _ := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}, WithEncryption(EncryptOptions{Recipients: f.rcpt, DedupSecret: tc.secret}))
				_, _, sent := pushEncrypted(t, enc, chunks)
				want := 8
				if round == 1 {
					want = tc.wantSent
				}
				if sent != want {
					t.Fatalf("checkpoint %d uploaded %d of 8 unchanged chunks, want %d", round+1, sent, want)
				}
			}
		})
	}
}

// TestEncryptStream: a layer put as a stream (larger than a chunk, in a
// store that streams) is encrypted as a whole and decrypts back.
func TestEncryptStream(t *testing.T) {
	f := newEncFixture(t, 1)
	dir := t.TempDir()
	enc, _ := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}, WithEncryption(EncryptOptions{Recipients: f.rcpt}))
	data := randomChunks(1, 3<<20+7)[0]
	layer := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerZstd, Digest: digest.FromBytes(data), Size: int64(len(data))}
	if err := ociimage.PutBlobFrom(t.Context(), enc, layer, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	m := ocispec.Manifest{Layers: []ocispec.Descriptor{layer}}
	cfg := []byte("{}")
	m.Config = ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: digest.FromBytes(cfg), Size: 2}
	if err := enc.PutBlob(t.Context(), m.Config, cfg); err != nil {
		t.Fatal(err)
	}
	m.SchemaVersion, m.MediaType = 2, ocispec.MediaTypeImageManifest
	md, err := enc.PutManifest(t.Context(), m)
	if err != nil {
		t.Fatal(err)
	}
	stored, err := openLayout(t, "oci:"+dir).Manifest(t.Context(), md)
	if err != nil {
		t.Fatal(err)
	}
	if stored.Layers[0].MediaType != ocispec.MediaTypeImageLayerZstd+"+encrypted" || stored.Config.Digest != m.Config.Digest {
		t.Fatalf("stored %+v", stored)
	}
	// The stream's ciphertext is what one pass of CTR from offset 0 gives.
	dec := Decrypt(openLayout(t, "oci:"+dir), f.priv)
	dm, err := dec.Manifest(t.Context(), md)
	if err != nil {
		t.Fatal(err)
	}
	if dm.Layers[0].Digest != layer.Digest {
		t.Fatalf("decrypted layer %+v", dm.Layers[0])
	}
	got, err := dec.Blob(t.Context(), dm.Layers[0], 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("streamed layer decrypts to other bytes")
	}
}

// TestCTRAtOffset: the key stream at any offset is the one a single pass
// gives, including across a carry of the counter's low 64 bits.
func TestCTRAtOffset(t *testing.T) {
	nonce := bytes.Repeat([]byte{0xff}, 16)
	nonce[0] = 1
	k, err := makeLayerKey(bytes.Repeat([]byte{3}, 32), nonce)
	if err != nil {
		t.Fatal(err)
	}
	data := randomChunks(1, 1000)[0]
	whole := make([]byte, len(data))
	k.xorAt(whole, data, 0)
	for _, off := range []int{1, 15, 16, 17, 500, 999} {
		part := make([]byte, len(data)-off)
		k.xorAt(part, data[off:], int64(off))
		if !bytes.Equal(part, whole[off:]) {
			t.Fatalf("key stream at offset %d differs", off)
		}
	}
	r := &ctrReaderAt{src: bytes.NewReader(data), k: k}
	got, _ := io.ReadAll(io.NewSectionReader(r, 0, int64(len(data))))
	if !bytes.Equal(got, whole) {
		t.Fatal("ctrReaderAt differs from one pass")
	}
}

func TestDecryptionKeyFileMode(t *testing.T) {
	f := newEncFixture(t, 1)
	p := f.privPath[0]
	if err := os.Chmod(p, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := LoadDecryptionKey(p)
	wantCode(t, err, errcode.Usage, "chmod 600")
	noKeyMaterial(t, err.Error(), f)
	for _, bad := range []os.FileMode{0o604, 0o660, 0o602} {
		if err := os.Chmod(p, bad); err != nil {
			t.Fatal(err)
		}
		_, err = LoadDecryptionKey(p)
		wantCode(t, err, errcode.Usage, "chmod 600")
	}
	// Group read is how a Secret reaches a non-root container (fsGroup).
	for _, good := range []os.FileMode{0o400, 0o600, 0o440, 0o640} {
		if err := os.Chmod(p, good); err != nil {
			t.Fatal(err)
		}
		if _, err := LoadDecryptionKey(p); err != nil {
			t.Fatalf("mode %04o: %v", good, err)
		}
	}
	// A public key where a private one belongs: refused without quoting it.
	pub := filepath.Join(t.TempDir(), "pub")
	b, _ := os.ReadFile(strings.TrimSuffix(p, ".key") + ".pub.pem")
	os.WriteFile(pub, b, 0o600)
	_, err = LoadDecryptionKey(pub)
	wantCode(t, err, errcode.Usage, "no PEM private key")
	if strings.Contains(err.Error(), strings.Split(string(b), "\n")[1]) {
		t.Fatalf("%q quotes the file", err)
	}
	if _, err := ParseRecipient(p); !errcode.Is(err, errcode.Usage) || !strings.Contains(err.Error(), "jwe:PATH") {
		t.Fatalf("a recipient without jwe: %v", err)
	}
}

func TestEncryptConcurrentPutsOfOneChunk(t *testing.T) {
	f := newEncFixture(t, 1)
	enc, _ := ociimage.Open(t.Context(), ociimage.Reference{Layout: t.TempDir()}, WithEncryption(EncryptOptions{Recipients: f.rcpt}))
	c := randomChunks(1, 10_000)[0]
	d := ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk, Digest: digest.FromBytes(c), Size: int64(len(c))}
	var wg sync.WaitGroup
	var mu sync.Mutex
	sent := 0
	for range 8 {
		wg.Go(func() {
			s, err := addBlob(t.Context(), enc, d, c)
			if err != nil {
				t.Error(err)
			}
			if s {
				mu.Lock()
				sent++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if sent != 1 {
		t.Fatalf("8 concurrent puts of one chunk sent it %d times", sent)
	}
}
