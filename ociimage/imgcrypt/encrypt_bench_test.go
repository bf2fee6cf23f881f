package imgcrypt

import (
	"bytes"
	"context"
	"encoding/json"
	"sync"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/internal/unhashed"
)

// nullRepo takes every blob and keeps none.
type nullRepo struct{ ociimage.Repository }

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
		d := ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk, Digest: digest.Digest("sha256:" + string(rune('a'+i%26))), Size: int64(len(data))}
		if err := e.PutBlob(context.Background(), d, data); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkEncryptChunkUndigested is BenchmarkEncryptChunk as the chunk
// pipeline stores an encrypted chunk: the plaintext's digest too, in the
// same pass. BenchmarkDigestChunk is what a plain checkpoint spends on the
// same chunk (its SHA-256): the two side by side are the encryption's cost.
func BenchmarkEncryptChunkUndigested(b *testing.B) {
	f := newEncFixture(b, 1)
	data := randomChunks(1, 8<<20)[0]
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		e, _ := Encrypt(nullRepo{}, EncryptOptions{Recipients: f.rcpt})
		if _, _, err := e.(*encrypting).AddUndigested(context.Background(), ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk}, data); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDigestChunk(b *testing.B) {
	data := randomChunks(1, 8<<20)[0]
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		_ = digest.FromBytes(data)
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

// benchImage is the shape of the bench guest's state image (make bench:
// 347 MiB of stream, 256 MiB of it random, stored as 287 MiB in 39
// chunks): 36 chunks of 8 MiB of incompressible data and 3 of a few KiB.
func benchImage() [][]byte {
	return append(randomChunks(36, 8<<20), randomChunks(3, 4<<10)...)
}

func benchBytes(chunks [][]byte) (n int64) {
	for _, c := range chunks {
		n += int64(len(c))
	}
	return n
}

// memRepo is a store in memory that hashes what the registry client
// hashes: nothing it puts (the registry checks), everything it fetches
// but BlobUnhashed's.
type memRepo struct {
	ociimage.Repository
	mu    sync.Mutex
	blobs map[digest.Digest][]byte
}

func newMemRepo() *memRepo { return &memRepo{blobs: map[digest.Digest][]byte{}} }

func (m *memRepo) HasBlob(_ context.Context, d digest.Digest) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.blobs[d]
	return ok, nil
}

func (m *memRepo) PutBlob(_ context.Context, desc ocispec.Descriptor, data []byte) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.blobs[desc.Digest] = bytes.Clone(data)
	return nil
}

func (m *memRepo) PutManifest(ctx context.Context, man ocispec.Manifest) (ocispec.Descriptor, error) {
	b, err := json.Marshal(man)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	desc := ocispec.Descriptor{MediaType: man.MediaType, Digest: digest.FromBytes(b), Size: int64(len(b))}
	return desc, m.PutBlob(ctx, desc, b)
}

func (m *memRepo) Manifest(ctx context.Context, desc ocispec.Descriptor) (ocispec.Manifest, error) {
	b, err := m.Blob(ctx, desc, ociimage.MaxManifestSize)
	if err != nil {
		return ocispec.Manifest{}, err
	}
	var man ocispec.Manifest
	return man, json.Unmarshal(b, &man)
}

func (m *memRepo) Blob(ctx context.Context, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	b, err := m.BlobUnhashed(ctx, unhashed.Key{}, desc, limit)
	if err == nil && digest.FromBytes(b) != desc.Digest {
		return nil, errcode.New(errcode.DigestMismatch, "blob %s is corrupt", desc.Digest)
	}
	return b, err
}

// BlobUnhashed returns a copy, as a fetch does.
func (m *memRepo) BlobUnhashed(_ context.Context, _ unhashed.Key, desc ocispec.Descriptor, _ int64) ([]byte, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	b, ok := m.blobs[desc.Digest]
	if !ok || int64(len(b)) != desc.Size {
		return nil, errcode.New(errcode.RegistryError, "blob %s is missing", desc.Digest)
	}
	return bytes.Clone(b), nil
}

// pushImage stores chunks through repo as a state image, two puts at a
// time as a checkpoint's uploaders do.
func pushImage(b *testing.B, repo ociimage.Repository, chunks [][]byte) ocispec.Descriptor {
	var layers []ocispec.Descriptor
	for _, c := range chunks {
		layers = append(layers, ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk, Digest: digest.FromBytes(c), Size: int64(len(c)),
			Annotations: map[string]string{ociimage.AnnotationRawSize: "1"}})
	}
	g, ctx := errgroup.WithContext(b.Context())
	g.SetLimit(2)
	for i, c := range chunks {
		g.Go(func() error { return repo.PutBlob(ctx, layers[i], c) })
	}
	if err := g.Wait(); err != nil {
		b.Fatal(err)
	}
	desc, err := ociimage.PushArtifact(b.Context(), repo, ociimage.Artifact{
		ArtifactType: ociimage.ArtifactTypeVMState, ConfigMediaType: ociimage.MediaTypeVMStateConfig,
		Config: testConfig{Machine: "pc", Memory: 1}, Layers: layers,
	})
	if err != nil {
		b.Fatal(err)
	}
	return desc
}

// BenchmarkCheckpointImage: what storing the bench image costs the
// client, plain and encrypted for an RSA-2048 recipient (random keys):
// the chunks are digested already (the chunker does it), so plain is
// little more than copies, and encrypted adds AES-CTR, the ciphertext's
// digest and HMAC, and the key wrapping.
func BenchmarkCheckpointImage(b *testing.B) {
	f := newEncFixture(b, 1)
	chunks := benchImage()
	for _, encrypted := range []bool{false, true} {
		b.Run(map[bool]string{false: "plain", true: "encrypted"}[encrypted], func(b *testing.B) {
			b.SetBytes(benchBytes(chunks))
			for b.Loop() {
				var repo ociimage.Repository = newMemRepo()
				if encrypted {
					repo, _ = Encrypt(repo, EncryptOptions{Recipients: f.rcpt})
				}
				pushImage(b, repo, chunks)
			}
		})
	}
}

// BenchmarkRestoreImage: reading the bench image back (manifest, then
// every chunk, two at a time as restore's workers do), plain and
// encrypted.
func BenchmarkRestoreImage(b *testing.B) {
	f := newEncFixture(b, 1)
	chunks := benchImage()
	for _, encrypted := range []bool{false, true} {
		b.Run(map[bool]string{false: "plain", true: "encrypted"}[encrypted], func(b *testing.B) {
			var repo ociimage.Repository = newMemRepo()
			if encrypted {
				repo, _ = Encrypt(repo, EncryptOptions{Recipients: f.rcpt})
			}
			desc := pushImage(b, repo, chunks)
			b.SetBytes(benchBytes(chunks))
			for b.Loop() {
				var r ociimage.Repository = ociimage.Underlying(repo)
				if encrypted {
					r = Decrypt(r, f.priv)
				}
				m, err := r.Manifest(b.Context(), desc)
				if err != nil {
					b.Fatal(err)
				}
				g, ctx := errgroup.WithContext(b.Context())
				g.SetLimit(2)
				for _, l := range m.Layers {
					g.Go(func() error { _, err := r.Blob(ctx, l, ociimage.MaxChunkSize); return err })
				}
				if err := g.Wait(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
