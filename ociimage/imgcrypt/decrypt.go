package imgcrypt

import (
	"context"
	"runtime"
	"sync"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/internal/unhashed"
)

// Decrypt returns repo with encrypted layers (IsEncrypted) read as
// plaintext: Manifest unwraps every encrypted layer's key with keys and
// returns the plaintext layer descriptors (media type without
// "+encrypted", the plaintext digest), and Blob of such a descriptor
// fetches the ciphertext (verified against its digest), checks its HMAC,
// decrypts it and verifies the plaintext digest before returning a byte.
// Callers read an encrypted image as a plain one. A layer none of keys
// opens makes Manifest fail with AUTH_FAILED, naming the keys it is
// encrypted for. Plaintext layers and configs pass through.
func Decrypt(repo ociimage.Repository, keys []DecryptionKey) ociimage.Repository {
	return &decrypting{Repository: repo, keys: keys, unwrapped: newUnwrapCache(), layers: map[digest.Digest]decLayer{}}
}

type decrypting struct {
	ociimage.Repository
	keys []DecryptionKey
	// unwrapped holds the CEKs the keys unwrapped: the layers of an image
	// vmsnap wrote share one per recipient (jwe.go).
	unwrapped *unwrapCache
	mu        sync.Mutex
	layers    map[digest.Digest]decLayer // by plaintext digest
}

type decLayer struct {
	enc ocispec.Descriptor
	key layerKey
}

// Unwrap returns the repository underneath.
func (d *decrypting) Unwrap() ociimage.Repository { return d.Repository }

func (d *decrypting) Manifest(ctx context.Context, desc ocispec.Descriptor) (ocispec.Manifest, error) {
	m, err := d.Repository.Manifest(ctx, desc)
	if err != nil {
		return m, err
	}
	layers := make([]ocispec.Descriptor, len(m.Layers))
	found := make([]decLayer, len(m.Layers))
	d.unwrapped.credit(desc.Digest, countEncrypted(m.Layers))
	// Unwrapping is a private-key operation per distinct wrapped CEK
	// (about a millisecond for RSA): one per recipient for an image vmsnap
	// wrote (jwe.go), one per layer for other writers. One goroutine per
	// core.
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(runtime.GOMAXPROCS(0))
	for i, l := range m.Layers {
		if !IsEncrypted(l) {
			layers[i] = l
			continue
		}
		g.Go(func() error {
			return errcode.Safely(func() error { // an image's annotations are untrusted
				if err := gctx.Err(); err != nil {
					return err
				}
				plain, k, err := decryptLayer(l, d.keys, d.unwrapped)
				if err != nil {
					return err
				}
				layers[i], found[i] = plain, decLayer{enc: l, key: k}
				return nil
			})
		})
	}
	if err := g.Wait(); err != nil {
		return ocispec.Manifest{}, err
	}
	d.mu.Lock()
	for i, f := range found {
		if f.enc.Digest != "" {
			d.layers[layers[i].Digest] = f
		}
	}
	d.mu.Unlock()
	m.Layers = layers
	return m, nil
}

func (d *decrypting) Blob(ctx context.Context, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	d.mu.Lock()
	l, ok := d.layers[desc.Digest]
	d.mu.Unlock()
	if !ok {
		return d.Repository.Blob(ctx, desc, limit)
	}
	if desc.Size != l.enc.Size {
		return nil, errcode.New(errcode.DigestMismatch, "blob %s: %d bytes asked for, the encrypted layer has %d", desc.Digest, desc.Size, l.enc.Size)
	}
	ct, err := fetchUnhashed(ctx, d.Repository, l.enc, limit)
	if err != nil {
		return nil, err
	}
	if !l.key.decryptTo(ct, desc.Digest) {
		clear(ct)
		return nil, errcode.New(errcode.DigestMismatch, "encrypted layer %s decrypts to data that is not %s: the image was altered", l.enc.Digest, desc.Digest)
	}
	return ct, nil
}

// fetchUnhashed fetches an encrypted layer's ciphertext checking its size
// but not its digest, where the store can (Layout, Registry). The
// plaintext digest checked after decryption verifies the same bytes, for
// one SHA-256 pass less (a plain restore makes one, an encrypted one now
// too):
//   - the layer key, nonce and plaintext digest come from the same
//     manifest as the ciphertext digest (pinned by its digest on restore),
//     inside the JWE that only the right CEK opens (AES-GCM);
//   - CTR with a fixed key and nonce is a bijection between equally long
//     byte strings: bytes other than the stored ciphertext decrypt to
//     other than the plaintext, so matching its digest takes a SHA-256
//     second preimage, as matching the ciphertext digest would;
//   - the length is checked before, and no byte leaves Blob until the
//     digest matched, as before.
//
// Nothing keeps the unhashed bytes under the ciphertext's digest (the
// registry does not remember it as known).
// The HMAC of the ciphertext is not recomputed either: the plaintext
// digest refuses every ciphertext the HMAC would.
func fetchUnhashed(ctx context.Context, repo ociimage.Repository, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	if u, ok := repo.(unhashedFetcher); ok {
		return u.BlobUnhashed(ctx, unhashed.Key{}, desc, limit)
	}
	return repo.Blob(ctx, desc, limit)
}

// unhashedFetcher is a store that fetches a blob checking its size alone
// (package unhashed): the layout and the registry client.
type unhashedFetcher interface {
	BlobUnhashed(context.Context, unhashed.Key, ocispec.Descriptor, int64) ([]byte, error)
}

var (
	_ unhashedFetcher = (*ociimage.Layout)(nil)
	_ unhashedFetcher = (*ociimage.Registry)(nil)
)

// TransformsReads says that d reads other than what is stored
// (ociimage.TransformsReads): the plaintext layers and their bytes.
func (d *decrypting) TransformsReads() bool { return true }

func countEncrypted(layers []ocispec.Descriptor) (n int) {
	for _, l := range layers {
		if IsEncrypted(l) {
			n++
		}
	}
	return n
}
