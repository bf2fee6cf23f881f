package ociimage

import (
	"context"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Copy copies the manifest src resolves to, with its config and layers, into
// dst, verifying every blob on the way, and returns the manifest's
// descriptor. It refuses before copying anything if the image's blobs add up
// to more than maxBytes (0: no limit). Blobs dst already has are skipped; the
// manifest is stored last, by digest: the caller tags it (TagManifest), so
// dst never names a partial copy. From a src that decrypts (imgcrypt), the
// copy is the plaintext image, under a manifest digest of its own.
func Copy(ctx context.Context, src, dst Repository, maxBytes int64, jobs int) (ocispec.Descriptor, error) {
	return CopyLayers(ctx, src, dst, maxBytes, jobs, nil)
}

// CopyLayers is Copy of the manifest, its config and only the layers
// keep accepts (all, if keep is nil): the copy's manifest is the same
// (same digest), and the layers left out are not in dst. For a reader
// that needs only some layers, such as a memory-file image's device state
// without its RAM regions.
func CopyLayers(ctx context.Context, src, dst Repository, maxBytes int64, jobs int, keep func(ocispec.Descriptor) bool) (ocispec.Descriptor, error) {
	desc, err := src.Resolve(ctx)
	if err != nil {
		return desc, err
	}
	m, err := src.Manifest(ctx, desc)
	if err != nil {
		return desc, err
	}
	blobs := []ocispec.Descriptor{m.Config}
	for _, l := range m.Layers {
		if keep == nil || keep(l) {
			blobs = append(blobs, l)
		}
	}
	var total int64
	for _, b := range blobs {
		if b.Size < 0 || b.Size > MaxChunkSize {
			return desc, errcode.New(errcode.InvalidInput, "blob %s declares %d bytes", b.Digest, b.Size)
		}
		total += b.Size
	}
	if maxBytes > 0 && total > maxBytes {
		return desc, errcode.New(errcode.InvalidInput, "the image holds %d bytes, more than the %d allowed here: raise the limit or give the volume more room", total, maxBytes)
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(max(jobs, 1))
	for _, b := range blobs {
		g.Go(func() error {
			return errcode.Safely(func() error { // a panic here must not end the process
				have, err := dst.HasBlob(gctx, b.Digest)
				if err != nil || have {
					return err
				}
				data, err := src.Blob(gctx, b, MaxChunkSize)
				if err != nil {
					return err
				}
				return dst.PutBlob(gctx, b, data)
			})
		})
	}
	if err := g.Wait(); err != nil {
		return desc, errcode.Ensure(errcode.RegistryError, err, "copying the image's blobs")
	}
	var got ocispec.Descriptor
	if keep == nil {
		got, err = dst.PutManifest(ctx, m)
	} else if l, ok := dst.(*Layout); ok {
		got, err = l.PutPartialManifest(ctx, m, func(d ocispec.Descriptor) bool { return !keep(d) })
	} else {
		return desc, errcode.New(errcode.Usage, "copying some of an image's layers works into an OCI layout only")
	}
	// A decrypted copy has its own manifest: the plaintext layers'.
	if err == nil && got.Digest != desc.Digest && !TransformsReads(src) {
		// The manifest is re-encoded on the way; vmsnap's own manifests
		// encode canonically, a foreign one might not.
		err = errcode.New(errcode.InvalidInput, "the copy of manifest %s encodes as %s: only manifests written by vmsnap can be copied", desc.Digest, got.Digest)
	}
	return got, err
}
