package imgcrypt

// An encrypting repository's manifests: their layers rewritten to the
// encrypted blobs, and never a layer in the clear.

import (
	"context"
	"maps"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// PutManifest stores m with every layer put through this repository
// replaced by its encrypted blob. A layer stored before (a memory-file
// delta names its parent's) keeps the encrypted blob it has: as given if
// it is encrypted, or the one it was read from through Decrypt. Any other
// layer is refused: it would be stored in the clear.
func (e *encrypting) PutManifest(ctx context.Context, m ocispec.Manifest) (ocispec.Descriptor, error) {
	layers := make([]ocispec.Descriptor, len(m.Layers))
	for i, l := range m.Layers {
		e.mu.Lock()
		el := e.layers[l.Digest]
		e.mu.Unlock()
		if el == nil {
			enc, ok := e.stored(l)
			if !ok {
				return ocispec.Descriptor{}, errcode.New(errcode.Internal, "layer %s was not stored through the encrypting repository and would be stored in the clear", l.Digest)
			}
			layers[i] = enc
			continue
		}
		select {
		case <-el.done:
		case <-ctx.Done():
			return ocispec.Descriptor{}, ctx.Err()
		}
		if el.err != nil {
			return ocispec.Descriptor{}, el.err
		}
		enc := l
		enc.MediaType, enc.Digest, enc.Size = el.desc.MediaType, el.desc.Digest, el.desc.Size
		enc.Annotations = maps.Clone(l.Annotations)
		if enc.Annotations == nil {
			enc.Annotations = map[string]string{}
		}
		maps.Copy(enc.Annotations, el.desc.Annotations)
		layers[i] = enc
	}
	m.Layers = layers
	return e.Repository.PutManifest(ctx, m)
}

// stored returns the encrypted form of a layer stored before this
// checkpoint.
func (e *encrypting) stored(l ocispec.Descriptor) (ocispec.Descriptor, bool) {
	if IsEncrypted(l) {
		return l, true
	}
	d, ok := e.Repository.(*decrypting)
	if !ok {
		return ocispec.Descriptor{}, false
	}
	d.mu.Lock()
	dl, ok := d.layers[l.Digest]
	d.mu.Unlock()
	return dl.enc, ok
}
