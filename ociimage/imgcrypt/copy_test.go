package imgcrypt

import (
	"bytes"
	"testing"

	"github.com/vmsnap/vmsnap/ociimage"
)

// ociimage.Copy through Decrypt, pinned as a restore pins it, copies the
// plaintext image under a manifest digest of its own: Copy sees through
// the pin that the source transforms what it reads
// (ociimage.TransformsReads) and does not take the new digest for a
// foreign manifest's.
func TestCopyThroughDecryptIsThePlaintextImage(t *testing.T) {
	f := newEncFixture(t, 1)
	srcDir, dstDir := t.TempDir(), t.TempDir()
	chunks := randomChunks(2, 1000)
	desc, plain, _ := pushEncrypted(t, openRef(t, "oci:"+srcDir, WithEncryption(EncryptOptions{Recipients: f.rcpt})), chunks)
	src := ociimage.Pinned(Decrypt(openLayout(t, "oci:"+srcDir), f.priv), desc)
	if !ociimage.TransformsReads(src) || ociimage.TransformsReads(openLayout(t, "oci:"+srcDir)) {
		t.Fatal("TransformsReads does not tell a decrypting repository from a plain one")
	}
	got, err := ociimage.Copy(t.Context(), src, openLayout(t, "oci:"+dstDir), 0, 2)
	if err != nil {
		t.Fatal(err)
	}
	if got.Digest == desc.Digest {
		t.Fatal("the copy has the encrypted manifest's digest")
	}
	dst := openLayout(t, "oci:"+dstDir)
	m, err := dst.Manifest(t.Context(), got)
	if err != nil {
		t.Fatal(err)
	}
	for i, l := range m.Layers {
		if IsEncrypted(l) || l.Digest != plain[i].Digest {
			t.Fatalf("layer %d of the copy is %s %s, want the plaintext %s", i, l.MediaType, l.Digest, plain[i].Digest)
		}
		b, err := dst.Blob(t.Context(), l, 1<<20)
		if err != nil || !bytes.Equal(b, chunks[i]) {
			t.Fatalf("layer %d of the copy: %v", i, err)
		}
	}
}
