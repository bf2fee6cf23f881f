package imgcrypt

import (
	"context"
	"testing"

	"github.com/vmsnap/vmsnap/internal/testing/keys"
	"github.com/vmsnap/vmsnap/ociimage"
)

// Encrypted and signed: the signature is of the manifest as stored (its
// encrypted layers), and a reader that decrypts verifies it.
func TestSignEncryptedImage(t *testing.T) {
	enc := newEncFixture(t, 1)
	dir := t.TempDir()
	priv, pub := keys.PEMPair(t, t.TempDir(), "signer", true)
	signer, err := ociimage.LoadSignKey(priv, nil)
	if err != nil {
		t.Fatal(err)
	}
	verifier, err := ociimage.LoadVerifyKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	w := openRef(t, "oci:"+dir, ociimage.WithSigner(signer), WithEncryption(EncryptOptions{Recipients: enc.rcpt}))
	desc, _, _ := pushEncrypted(t, w, randomChunks(2, 1000))
	r := openRef(t, "oci:"+dir+"@"+desc.Digest.String(), ociimage.WithVerifyKeys(verifier), WithDecryptionKeys(enc.priv...))
	got, err := r.Resolve(t.Context())
	if err != nil || got.Digest != desc.Digest {
		t.Fatalf("resolve %v, %v", got.Digest, err)
	}
	if _, err := r.Manifest(context.Background(), got); err != nil {
		t.Fatal(err)
	}
}
