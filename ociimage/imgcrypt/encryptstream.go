package imgcrypt

// Encrypting a layer of any size as it streams: the ciphertext is read
// twice from the plaintext, to digest it and to upload it, never stored.

import (
	"context"
	"io"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/sha256pair"
	"github.com/vmsnap/vmsnap/ociimage"
)

// PutBlobStream encrypts a layer of any size as it streams (CTR can start
// anywhere, so the ciphertext is read twice without being stored: once to
// digest it, once to upload it).
func (e *encrypting) PutBlobStream(ctx context.Context, desc ocispec.Descriptor, src io.ReaderAt) error {
	if isConfig(desc.MediaType) {
		return ociimage.PutBlobFrom(ctx, e.Repository, desc, src)
	}
	_, err := e.once(ctx, desc.Digest, func() (ocispec.Descriptor, bool, error) {
		k, err := newLayerKey(desc.Digest, e.o.DedupSecret)
		if err != nil {
			return ocispec.Descriptor{}, false, err
		}
		ct := &ctrReaderAt{src: src, k: k}
		h := sha256pair.NewWithPlain(k.key)
		buf, cbuf := make([]byte, 1<<20), make([]byte, 1<<20)
		for off := int64(0); off < desc.Size; {
			n := int(min(int64(len(buf)), desc.Size-off))
			got, err := src.ReadAt(buf[:n], off)
			if got < n {
				if err == nil || err == io.EOF {
					return ocispec.Descriptor{}, false, errcode.New(errcode.DigestMismatch, "data for blob %s is shorter than the %d bytes its descriptor says", desc.Digest, desc.Size)
				}
				return ocispec.Descriptor{}, false, errcode.Ensure(errcode.Internal, err, "reading layer %s to encrypt it", desc.Digest)
			}
			k.xorAt(cbuf[:n], buf[:n], off)
			h.Write2(buf[:n], cbuf[:n])
			off += int64(n)
		}
		plain, sum, mac := h.Sums()
		if digest.NewDigestFromBytes(digest.SHA256, plain[:]) != desc.Digest {
			return ocispec.Descriptor{}, false, errcode.New(errcode.DigestMismatch, "data for blob %s does not match its descriptor", desc.Digest)
		}
		enc, err := e.describe(k, desc, sum, mac)
		if err != nil {
			return enc, false, err
		}
		return enc, true, ociimage.PutBlobFrom(ctx, e.Repository, enc, ct)
	})
	return err
}

// ctrReaderAt is a layer's ciphertext, read from its plaintext at any
// offset.
type ctrReaderAt struct {
	src io.ReaderAt
	k   layerKey
}

func (c *ctrReaderAt) ReadAt(p []byte, off int64) (int, error) {
	n, err := c.src.ReadAt(p, off)
	c.k.xorAt(p[:n], p[:n], off)
	return n, err
}
