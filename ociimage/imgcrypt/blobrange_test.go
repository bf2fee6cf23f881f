package imgcrypt

import (
	"bytes"
	"context"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// A range of an encrypted layer would be ciphertext: ReadBlobRange refuses
// a repository read through Decrypt, rather than hand it back as if it were
// the plaintext.
func TestBlobRangeThroughDecryptRefuses(t *testing.T) {
	repo := openLayout(t, "oci:"+t.TempDir())
	data := bytes.Repeat([]byte("vmsnap"), 1<<16)
	d := ocispec.Descriptor{MediaType: ociimage.MediaTypeRAMPack, Digest: digest.FromBytes(data), Size: int64(len(data))}
	if err := ociimage.PutBlobFrom(context.Background(), repo, d, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	if got, err := ociimage.ReadBlobRange(context.Background(), repo, d, 6, 6); err != nil || string(got) != "vmsnap" {
		t.Fatalf("a range of the plain layout: %q, %v", got, err)
	}
	if _, err := ociimage.ReadBlobRange(context.Background(), Decrypt(repo, nil), d, 0, 10); errcode.Of(err) != errcode.Usage {
		t.Fatalf("a range through Decrypt: %v, want USAGE", err)
	}
}
