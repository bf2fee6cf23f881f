package imgcrypt

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/go-jose/go-jose/v4"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// jweOf returns a stored layer's JWE (the one in its annotation).
func jweOf(t *testing.T, l ocispec.Descriptor) []byte {
	t.Helper()
	ws := wrappedKeys(l)
	if len(ws) != 1 {
		t.Fatalf("layer %s has %d JWEs, want 1", l.Digest, len(ws))
	}
	return ws[0]
}

// The JWEs vmsnap writes are standard: go-jose's own decrypter, given the
// private key as ocicrypt gives it, opens every one; the layers of one
// image share their wrapped key (one unwrap per recipient on restore)
// and no two share an IV; the public options hold the ciphertext's
// HMAC-SHA256 under the layer key, and the descriptor its SHA-256.
func TestEncryptStandardJWEsShareTheirWrappedKey(t *testing.T) {
	f := newEncFixture(t, 2) // RSA and EC
	for _, rcpt := range [][]Recipient{f.rcpt[:1], f.rcpt[1:], f.rcpt} {
		dir := t.TempDir()
		enc, _ := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}, WithEncryption(EncryptOptions{Recipients: rcpt}))
		desc, plain, _ := pushEncrypted(t, enc, randomChunks(6, 5000))
		raw := openLayout(t, "oci:"+dir)
		m, err := raw.Manifest(t.Context(), desc)
		if err != nil {
			t.Fatal(err)
		}
		keys, ivs := map[string]bool{}, map[string]bool{}
		for i, l := range m.Layers {
			w := jweOf(t, l)
			var j jweJSON
			if err := json.Unmarshal(w, &j); err != nil {
				t.Fatal(err)
			}
			wrapped := j.EncryptedKey
			for _, r := range j.Recipients {
				wrapped += "," + r.EncryptedKey
			}
			keys[j.Protected+wrapped], ivs[j.IV] = true, true
			obj, err := jose.ParseEncrypted(string(w), unwrapAlgorithms, contentAlgorithms)
			if err != nil {
				t.Fatal(err)
			}
			ct, err := raw.Blob(t.Context(), l, ociimage.MaxChunkSize)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range rcpt {
				priv := f.priv[0]
				if r.ID == f.priv[1].ID {
					priv = f.priv[1]
				}
				_, _, b, err := obj.DecryptMulti(priv.Key)
				if err != nil {
					t.Fatalf("layer %d: go-jose cannot open it with %s's key: %v", i, r.ID, err)
				}
				var p privateOpts
				if err := json.Unmarshal(b, &p); err != nil || p.Digest != plain[i].Digest {
					t.Fatalf("layer %d: private options %s (%v)", i, b, err)
				}
				var pub publicOpts
				pb, _ := base64.StdEncoding.DecodeString(l.Annotations[ociimage.AnnotationEncPubOpts])
				if err := json.Unmarshal(pb, &pub); err != nil {
					t.Fatal(err)
				}
				mac := hmac.New(sha256.New, p.SymmetricKey)
				mac.Write(ct)
				if !hmac.Equal(pub.Hmac, mac.Sum(nil)) || !bytes.Equal(pub.CipherOptions["hmac"], pub.Hmac) {
					t.Fatalf("layer %d: the HMAC in its public options is not the ciphertext's", i)
				}
			}
			if digest.FromBytes(ct) != l.Digest {
				t.Fatalf("layer %d: descriptor digest %s is not its ciphertext's", i, l.Digest)
			}
		}
		if len(keys) != 1 || len(ivs) != len(m.Layers) {
			t.Fatalf("%d recipients: %d distinct wrapped keys and %d IVs over %d layers, want 1 and %d",
				len(rcpt), len(keys), len(ivs), len(m.Layers), len(m.Layers))
		}

		// One unwrap per image and key.
		dec := Decrypt(raw, f.priv).(*decrypting)
		if _, err := dec.Manifest(t.Context(), desc); err != nil {
			t.Fatal(err)
		}
		if n := len(dec.unwrapped.m); n != 1 {
			t.Fatalf("%d recipients: %d unwraps for one image", len(rcpt), n)
		}
	}
}

// The unwrap cache answers only for exactly the inputs it unwrapped: the
// same encrypted_key under another algorithm, another ephemeral key, or
// for another private key is unwrapped afresh (and fails).
func TestUnwrapCacheKeyedByEveryInput(t *testing.T) {
	f := newEncFixture(t, 4) // RSA, EC, RSA, EC
	cache := newUnwrapCache()
	header := func(k *sealKey) (jose.Header, []byte) {
		t.Helper()
		b, _ := base64.RawURLEncoding.DecodeString(k.protected)
		var raw map[string]json.RawMessage
		if err := json.Unmarshal(b, &raw); err != nil {
			t.Fatal(err)
		}
		var h jose.Header
		json.Unmarshal(raw["alg"], &h.Algorithm)
		json.Unmarshal(raw["kid"], &h.KeyID)
		if epk, ok := raw["epk"]; ok {
			var v any
			json.Unmarshal(epk, &v)
			h.ExtraHeaders = map[jose.HeaderKey]any{"epk": v}
		}
		ek, _ := base64.RawURLEncoding.DecodeString(k.encryptedKey)
		return h, ek
	}

	// RSA: RSA-OAEP unwraps; the same bytes as RSA-OAEP-256, or for the
	// other RSA key, do not.
	rk, err := newSealKey(f.rcpt[:1])
	if err != nil {
		t.Fatal(err)
	}
	h, ek := header(rk)
	if _, err := (cachedKey{f.priv[0], cache}).DecryptKey(ek, h); err != nil {
		t.Fatal(err)
	}
	h.Algorithm = string(jose.RSA_OAEP_256)
	if _, err := (cachedKey{f.priv[0], cache}).DecryptKey(ek, h); err == nil {
		t.Fatal("an encrypted_key unwrapped as RSA-OAEP was accepted as RSA-OAEP-256")
	}
	h.Algorithm = string(jose.RSA_OAEP)
	if _, err := (cachedKey{f.priv[2], cache}).DecryptKey(ek, h); err == nil {
		t.Fatal("an encrypted_key unwrapped by one RSA key was accepted for another")
	}

	// EC: the encrypted_key of one ephemeral key, presented with another's.
	k1, err := newSealKey(f.rcpt[1:2])
	if err != nil {
		t.Fatal(err)
	}
	k2, err := newSealKey(f.rcpt[1:2])
	if err != nil {
		t.Fatal(err)
	}
	h1, ek1 := header(k1)
	h2, ek2 := header(k2)
	cek1, err := (cachedKey{f.priv[1], cache}).DecryptKey(ek1, h1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := (cachedKey{f.priv[1], cache}).DecryptKey(ek1, h2); err == nil {
		t.Fatal("an encrypted_key was accepted with another ephemeral key")
	}
	cek2, err := (cachedKey{f.priv[1], cache}).DecryptKey(ek2, h2)
	if err != nil || bytes.Equal(cek1, cek2) {
		t.Fatalf("two ephemeral keys gave the same CEK (%v)", err)
	}
	if _, err := (cachedKey{f.priv[3], cache}).DecryptKey(ek1, h1); err == nil {
		t.Fatal("an encrypted_key unwrapped by one EC key was accepted for another")
	}
	// And the cache gives back what the key gives.
	again, err := (cachedKey{f.priv[1], newUnwrapCache()}).DecryptKey(ek1, h1)
	if err != nil || !bytes.Equal(again, cek1) {
		t.Fatal("a fresh unwrap differs from the cached one")
	}
}

// A layer whose JWE names the wrapped key of another image (whose CEK the
// restore has cached) but was sealed under a CEK of its own is not opened
// with the cached CEK: AUTH_FAILED, as without the cache.
func TestDecryptForeignJWEWithACachedWrappedKey(t *testing.T) {
	f := newEncFixture(t, 1)
	dir := t.TempDir()
	encA, _ := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}, WithEncryption(EncryptOptions{Recipients: f.rcpt}))
	encB, _ := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}, WithEncryption(EncryptOptions{Recipients: f.rcpt}))
	chunks := randomChunks(2, 3000)
	descA, _, _ := pushEncrypted(t, encA, chunks[:1])
	descB, _, _ := pushEncrypted(t, encB, chunks[1:])
	raw := openLayout(t, "oci:"+dir)
	mA, _ := raw.Manifest(t.Context(), descA)
	mB, _ := raw.Manifest(t.Context(), descB)

	var jA, jB jweJSON
	json.Unmarshal(jweOf(t, mA.Layers[0]), &jA)
	json.Unmarshal(jweOf(t, mB.Layers[0]), &jB)
	if jA.EncryptedKey == jB.EncryptedKey {
		t.Fatal("two Encrypt repositories share a CEK")
	}
	jB.EncryptedKey = jA.EncryptedKey
	forgedJWE, _ := json.Marshal(jB)
	forged := mB.Layers[0]
	forged.Annotations = map[string]string{}
	for k, v := range mB.Layers[0].Annotations {
		forged.Annotations[k] = v
	}
	forged.Annotations[ociimage.AnnotationEncKeysJWE] = base64.StdEncoding.EncodeToString(forgedJWE)
	m := mA
	m.Layers = []ocispec.Descriptor{mA.Layers[0], forged}
	desc, err := raw.PutManifest(t.Context(), m)
	if err != nil {
		t.Fatal(err)
	}
	dec := Decrypt(raw, f.priv).(*decrypting)
	_, err = dec.Manifest(t.Context(), desc)
	wantCode(t, err, errcode.AuthFailed, f.rcpt[0].ID)
	noKeyMaterial(t, err.Error(), f)
	if len(dec.unwrapped.m) != 1 {
		t.Fatalf("%d unwraps, want the one of image A", len(dec.unwrapped.m))
	}
}

// A chunk altered in an image whose CEK is cached, and whose ciphertext
// digest restore no longer recomputes, is refused (DIGEST_MISMATCH,
// nothing returned); the others read fine. Flipped, cut short and grown,
// from a layout and from a registry.
func TestDecryptTamperedChunkWithCachedKey(t *testing.T) {
	f := newEncFixture(t, 1)
	chunks := randomChunks(4, 70_000)

	check := func(t *testing.T, dec ociimage.Repository, desc ocispec.Descriptor, bad int) {
		t.Helper()
		m, err := dec.Manifest(t.Context(), desc)
		if err != nil {
			t.Fatal(err)
		}
		for i, l := range m.Layers {
			got, err := dec.Blob(t.Context(), l, ociimage.MaxChunkSize)
			if i == bad {
				wantCode(t, err, errcode.DigestMismatch, "")
				if got != nil {
					t.Fatal("a tampered layer returned bytes")
				}
				continue
			}
			if err != nil || !bytes.Equal(got, chunks[i]) {
				t.Fatalf("layer %d: %v", i, err)
			}
		}
	}

	t.Run("layout", func(t *testing.T) {
		dir := t.TempDir()
		enc, _ := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}, WithEncryption(EncryptOptions{Recipients: f.rcpt}))
		desc, _, _ := pushEncrypted(t, enc, chunks)
		stored, _ := openLayout(t, "oci:"+dir).Manifest(t.Context(), desc)
		blob := filepath.Join(dir, "blobs", "sha256", stored.Layers[2].Digest.Encoded())
		orig, _ := os.ReadFile(blob)
		for name, b := range map[string][]byte{
			"flipped": append(append([]byte(nil), orig[:500]...), append([]byte{orig[500] ^ 4}, orig[501:]...)...),
			"short":   orig[:len(orig)-1],
			"long":    append(append([]byte(nil), orig...), 0),
		} {
			t.Run(name, func(t *testing.T) {
				if err := os.WriteFile(blob, b, 0o644); err != nil {
					t.Fatal(err)
				}
				dec, _ := ociimage.Open(t.Context(), ociimage.Reference{Layout: dir}.WithDigest(desc.Digest), WithDecryptionKeys(f.priv...))
				check(t, dec, desc, 2)
			})
		}
	})

	t.Run("registry", func(t *testing.T) {
		reg := newFakeRegistry(t)
		enc := reg.open(t, "vm:enc", WithEncryption(EncryptOptions{Recipients: f.rcpt}))
		desc, _, _ := pushEncrypted(t, enc, chunks)
		stored, err := reg.open(t, "vm:enc").Manifest(t.Context(), desc)
		if err != nil {
			t.Fatal(err)
		}
		path := "/v2/vm/blobs/" + string(stored.Layers[1].Digest)
		orig := reg.fetchRaw(t, path)
		for name, b := range map[string][]byte{
			"flipped": append(append([]byte(nil), orig[:10]...), append([]byte{orig[10] ^ 0x80}, orig[11:]...)...),
			"short":   orig[:len(orig)-7],
		} {
			t.Run(name, func(t *testing.T) {
				reg.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
					if r.Method != http.MethodGet || r.URL.Path != path {
						return false
					}
					w.Write(b)
					return true
				})
				check(t, reg.open(t, "vm:enc", WithDecryptionKeys(f.priv...)), desc, 1)
			})
		}
		reg.setIntercept(nil)
		if strings.Contains(string(orig), string(chunks[1][:32])) {
			t.Fatal("the registry holds the plaintext")
		}
	})
}

// Images that other writers made (ocicrypt, vmsnap before the shared CEK:
// go-jose's Encrypter, a CEK per layer) read as before, for RSA and EC
// keys, one recipient or several, one unwrap per layer.
func TestDecryptGoJoseWrappedKeys(t *testing.T) {
	f := newEncFixture(t, 2)
	k, err := newLayerKey("", nil)
	if err != nil {
		t.Fatal(err)
	}
	priv, _ := json.Marshal(privateOpts{SymmetricKey: k.key, Digest: digest.FromString("x"), CipherOptions: map[string][]byte{"nonce": k.nonce}})
	pub, _ := json.Marshal(publicOpts{CipherType: cipherAES256CTR})
	for _, rcpt := range [][]Recipient{f.rcpt[:1], f.rcpt[1:], f.rcpt} {
		cache := newUnwrapCache()
		for i := range 3 {
			var rs []jose.Recipient
			for _, r := range rcpt {
				alg := jose.RSA_OAEP
				if r.ID == f.priv[1].ID {
					alg = jose.ECDH_ES_A256KW
				}
				rs = append(rs, jose.Recipient{Algorithm: alg, Key: r.Key, KeyID: r.ID})
			}
			enc, err := jose.NewMultiEncrypter(jose.A256GCM, rs, nil)
			if err != nil {
				t.Fatal(err)
			}
			obj, err := enc.Encrypt(priv)
			if err != nil {
				t.Fatal(err)
			}
			l := ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk + ociimage.MediaTypeEncryptedSuffix, Digest: digest.FromString("ct"), Size: 1,
				Annotations: map[string]string{
					ociimage.AnnotationEncKeysJWE: base64.StdEncoding.EncodeToString([]byte(obj.FullSerialize())),
					ociimage.AnnotationEncPubOpts: base64.StdEncoding.EncodeToString(pub),
				}}
			for _, key := range f.priv {
				if !strings.Contains(strings.Join(EncryptedFor(l), " "), key.ID) {
					continue
				}
				plain, got, err := decryptLayer(l, []DecryptionKey{key}, cache)
				if err != nil || plain.Digest != digest.FromString("x") || !bytes.Equal(got.key, k.key) {
					t.Fatalf("%d recipients, layer %d, key %s: %v", len(rcpt), i, key.ID, err)
				}
			}
		}
		n := 0
		for _, u := range cache.m {
			if u.err == nil {
				n++
			}
		}
		if n != 3*len(rcpt) {
			t.Fatalf("%d recipients: %d unwraps for 3 layers with a CEK each, want %d", len(rcpt), n, 3*len(rcpt))
		}
	}
}
