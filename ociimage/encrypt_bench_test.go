package ociimage

import (
	"context"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// nullRepo takes every blob and keeps none.
type nullRepo struct{ Repository }

func (nullRepo) HasBlob(context.Context, digest.Digest) (bool, error) { return false, nil }
func (nullRepo) PutBlob(context.Context, ocispec.Descriptor, []byte) error {
	return nil
}

// BenchmarkEncryptChunk: the encrypting store's CPU per 8 MiB chunk
// (AES-CTR, SHA-256 and HMAC-SHA256 of the ciphertext, one RSA-OAEP wrap).
func BenchmarkEncryptChunk(b *testing.B) {
	f := newEncFixture(b, 1)
	data := randomChunks(1, 8<<20)[0]
	b.SetBytes(int64(len(data)))
	for i := 0; b.Loop(); i++ {
		e, _ := Encrypt(nullRepo{}, EncryptOptions{Recipients: f.rcpt})
		d := ocispec.Descriptor{MediaType: MediaTypeChunk, Digest: digest.Digest("sha256:" + string(rune('a'+i%26))), Size: int64(len(data))}
		if err := e.PutBlob(context.Background(), d, data); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDecryptChunk: the decrypting store's CPU per 8 MiB chunk,
// without the store's own digest check of the ciphertext (CTR and the
// plaintext's SHA-256).
func BenchmarkDecryptChunk(b *testing.B) {
	k, _ := newLayerKey("", nil)
	data := randomChunks(1, 8<<20)[0]
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		k.xorAt(data, data, 0)
		_ = digest.FromBytes(data)
	}
}
