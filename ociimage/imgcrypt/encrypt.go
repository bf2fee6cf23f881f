package imgcrypt

import (
	"context"
	"sync"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/sha256pair"
	"github.com/vmsnap/vmsnap/ociimage"
)

// EncryptOptions says how Encrypt encrypts layers.
type EncryptOptions struct {
	// Recipients can decrypt the layers; at least one.
	Recipients []Recipient
	// DedupSecret, when set, derives each layer's key and nonce from it and
	// the layer's plaintext digest (HMAC-SHA256), so that an unchanged
	// chunk encrypts to the same blob in every checkpoint made with the
	// same secret and is not uploaded again. The trade-off: anyone who can
	// read the repository sees which layers are equal between those
	// checkpoints (not their content, and not whether they equal a layer a
	// reader holds without the secret). Without it every layer has a random
	// key, and every checkpoint uploads everything again.
	DedupSecret []byte
}

// Encrypt returns repo with its layers encrypted as the OCI image
// encryption convention has it (ocicrypt, containerd's imgcrypt, skopeo):
// every blob put, of whatever media type, except configs, is stored
// encrypted under a key of its own wrapped for o.Recipients, and
// PutManifest rewrites the manifest's layers to the encrypted blobs
// (MediaType+"+encrypted", the keys and cipher options in annotations).
// Configs and manifests stay plaintext. Callers put and name the plaintext
// blobs as before. HasBlob reports only the layers put through this
// repository, so that every other layer is put (and encrypted).
func Encrypt(repo ociimage.Repository, o EncryptOptions) (ociimage.Repository, error) {
	if len(o.Recipients) == 0 {
		return nil, errcode.New(errcode.Usage, "encryption needs at least one recipient (%s)", errcode.Field("encryptRecipient"))
	}
	return &encrypting{Repository: repo, o: o, seal: newSealer(o.Recipients), layers: map[digest.Digest]*encLayer{}}, nil
}

type encrypting struct {
	ociimage.Repository
	o      EncryptOptions
	seal   *sealer // wraps every layer key of this repository (jwe.go)
	mu     sync.Mutex
	layers map[digest.Digest]*encLayer // by plaintext digest
}

// encLayer is one plaintext layer's encrypted blob, once done is closed.
type encLayer struct {
	done chan struct{}
	desc ocispec.Descriptor // the encrypted blob, with its annotations
	err  error
}

// Unwrap returns the repository underneath.
func (e *encrypting) Unwrap() ociimage.Repository { return e.Repository }

// isConfig reports whether a blob of this media type is a config, which
// stays plaintext (its digest is what the manifest's config names).
func isConfig(mediaType string) bool {
	switch mediaType {
	case ociimage.MediaTypeVMStateConfig, ociimage.MediaTypeDiskConfig, ocispec.MediaTypeImageConfig,
		"application/vnd.docker.container.image.v1+json", ocispec.MediaTypeEmptyJSON:
		return true
	}
	return false
}

func (e *encrypting) HasBlob(ctx context.Context, d digest.Digest) (bool, error) {
	e.mu.Lock()
	l := e.layers[d]
	e.mu.Unlock()
	if l == nil {
		return false, nil
	}
	select {
	case <-l.done:
		return l.err == nil, nil
	case <-ctx.Done():
		return false, ctx.Err()
	}
}

func (e *encrypting) PutBlob(ctx context.Context, desc ocispec.Descriptor, data []byte) error {
	_, err := e.AddBlob(ctx, desc, data)
	return err
}

// AddBlob encrypts and stores a layer, and reports whether the store was
// sent any data (with a DedupSecret, an unchanged layer is not).
func (e *encrypting) AddBlob(ctx context.Context, desc ocispec.Descriptor, data []byte) (bool, error) {
	if isConfig(desc.MediaType) {
		return addBlob(ctx, e.Repository, desc, data)
	}
	// The plaintext is not hashed again (its writer just digested it, as
	// a registry put is not checked here either): a wrong desc.Digest is
	// wrapped as the plaintext digest, and restore refuses the layer
	// (DIGEST_MISMATCH), never returns it.
	if int64(len(data)) != desc.Size {
		return false, errcode.New(errcode.DigestMismatch, "data for blob %s is %d bytes, not the %d its descriptor says", desc.Digest, len(data), desc.Size)
	}
	return e.once(ctx, desc.Digest, func() (ocispec.Descriptor, bool, error) {
		k, err := newLayerKey(desc.Digest, e.o.DedupSecret)
		if err != nil {
			return ocispec.Descriptor{}, false, err
		}
		ct := getBuffer(len(data))
		defer putBuffer(ct)
		h := sha256pair.New(k.key)
		k.encrypt(ct, data, func(_, c []byte) { h.Write(c) })
		sum, mac := h.Sums()
		return e.store(ctx, k, desc, sum, mac, ct)
	})
}

// AddUndigested is AddBlob for a layer whose digest is not known yet (the
// chunk pipeline's, ociimage/chunk): it hashes the plaintext in the same
// pass that encrypts it and hashes the ciphertext (sha256pair.WithPlain),
// and returns desc with its digest and size. With a DedupSecret the key
// derives from the digest, so the plaintext is digested first.
func (e *encrypting) AddUndigested(ctx context.Context, desc ocispec.Descriptor, data []byte) (ocispec.Descriptor, bool, error) {
	desc.Size = int64(len(data))
	if isConfig(desc.MediaType) || e.o.DedupSecret != nil {
		desc.Digest = digest.FromBytes(data)
		sent, err := e.AddBlob(ctx, desc, data)
		return desc, sent, err
	}
	k, err := newLayerKey("", nil)
	if err != nil {
		return ocispec.Descriptor{}, false, err
	}
	ct := getBuffer(len(data))
	defer putBuffer(ct)
	h := sha256pair.NewWithPlain(k.key)
	k.encrypt(ct, data, h.Write2)
	plain, sum, mac := h.Sums()
	desc.Digest = digest.NewDigestFromBytes(digest.SHA256, plain[:])
	// A layer with this digest already put (a chunk repeated in the
	// stream) is not put again: this encryption of it is dropped.
	sent, err := e.once(ctx, desc.Digest, func() (ocispec.Descriptor, bool, error) {
		return e.store(ctx, k, desc, sum, mac, ct)
	})
	return desc, sent, err
}

// store puts a layer's ciphertext, described from its sums, into the
// repository underneath. The store does not keep ct once the put returns
// (the Repository contract), so its buffer is reused.
func (e *encrypting) store(ctx context.Context, k layerKey, plain ocispec.Descriptor, sum, mac [sha256pair.Size]byte, ct []byte) (ocispec.Descriptor, bool, error) {
	enc, err := e.describe(k, plain, sum, mac)
	if err != nil {
		return enc, false, err
	}
	sent, err := addBlob(ctx, e.Repository, enc, ct)
	return enc, sent, err
}

// once runs put for the first caller of a plaintext digest; later callers
// share its result. A failed put is forgotten, so it can be tried again.
func (e *encrypting) once(ctx context.Context, d digest.Digest, put func() (ocispec.Descriptor, bool, error)) (bool, error) {
	e.mu.Lock()
	if l := e.layers[d]; l != nil {
		e.mu.Unlock()
		select {
		case <-l.done:
			return false, l.err
		case <-ctx.Done():
			return false, ctx.Err()
		}
	}
	l := &encLayer{done: make(chan struct{})}
	e.layers[d] = l
	e.mu.Unlock()
	var sent bool
	l.desc, sent, l.err = put()
	if l.err != nil {
		e.mu.Lock()
		delete(e.layers, d)
		e.mu.Unlock()
	}
	close(l.done)
	return sent, l.err
}

// describe returns the encrypted blob's descriptor, from the hashes of its
// ciphertext: its SHA-256 and its HMAC.
func (e *encrypting) describe(k layerKey, plain ocispec.Descriptor, sum, mac [sha256pair.Size]byte) (ocispec.Descriptor, error) {
	ann, err := k.annotations(plain.Digest, mac[:], e.seal)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	return ocispec.Descriptor{
		MediaType:   plain.MediaType + ociimage.MediaTypeEncryptedSuffix,
		Digest:      digest.NewDigestFromBytes(digest.SHA256, sum[:]),
		Size:        plain.Size,
		Annotations: ann,
	}, nil
}

// addBlob puts data into repo, saying whether it was sent: through the
// store's AddBlob when it has one (one request for a blob it holds), else
// HasBlob and PutBlob.
func addBlob(ctx context.Context, repo ociimage.Repository, desc ocispec.Descriptor, data []byte) (bool, error) {
	if a, ok := repo.(interface {
		AddBlob(context.Context, ocispec.Descriptor, []byte) (bool, error)
	}); ok {
		return a.AddBlob(ctx, desc, data)
	}
	have, err := repo.HasBlob(ctx, desc.Digest)
	if err != nil || have {
		return false, err
	}
	return true, repo.PutBlob(ctx, desc, data)
}

// cryptBlock is how much is encrypted before it is hashed.
const cryptBlock = 256 << 10

// buffers recycles ciphertext buffers: a checkpoint encrypts its whole
// stream chunk by chunk, and fresh buffers would cost page faults and GC.
var buffers sync.Pool

func getBuffer(n int) []byte {
	if b, ok := buffers.Get().(*[]byte); ok && cap(*b) >= n {
		return (*b)[:n]
	}
	return make([]byte, n)
}

func putBuffer(b []byte) { buffers.Put(&b) }
