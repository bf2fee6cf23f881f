package ociimage

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/atomicfile"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// BlobStreamer is an optional extension of Repository, found by type
// assertion: it stores a blob of any size from src (desc.Size bytes from
// offset 0) without holding it in memory. Repository.PutBlob is for chunks
// of at most MaxChunkSize; a container layer can be larger.
//
// src is an io.ReaderAt rather than an io.Reader so that an implementation
// can read it again, for instance to retry a failed upload: a file, a
// containerd content.ReaderAt or a bytes.Reader all qualify.
//
// Like PutBlob, it refuses data whose digest or size differ from desc
// (DIGEST_MISMATCH) and never makes a wrong blob visible under desc.Digest.
type BlobStreamer interface {
	PutBlobStream(ctx context.Context, desc ocispec.Descriptor, src io.ReaderAt) error
}

var (
	_ BlobStreamer = (*Layout)(nil)
	_ BlobStreamer = (*Registry)(nil)
)

// PutBlobFrom stores the blob desc names from src: streamed if repo is a
// BlobStreamer, else read into memory and given to PutBlob, which then
// refuses a blob larger than MaxChunkSize before reading it.
func PutBlobFrom(ctx context.Context, repo Repository, desc ocispec.Descriptor, src io.ReaderAt) error {
	if s, ok := repo.(BlobStreamer); ok {
		return s.PutBlobStream(ctx, desc, src)
	}
	if desc.Size < 0 || desc.Size > MaxChunkSize {
		return errcode.New(errcode.InvalidInput,
			"blob %s is %d bytes; this store takes at most %d bytes per blob and cannot stream larger ones", desc.Digest, desc.Size, MaxChunkSize)
	}
	data := make([]byte, desc.Size)
	if _, err := src.ReadAt(data, 0); err != nil && !(errors.Is(err, io.EOF) && desc.Size == 0) {
		if errors.Is(err, io.EOF) {
			return errcode.New(errcode.DigestMismatch, "data for blob %s is shorter than the %d bytes its descriptor says", desc.Digest, desc.Size)
		}
		return errcode.Wrap(errcode.Internal, err, "reading blob %s", desc.Digest)
	}
	return repo.PutBlob(ctx, desc, data)
}

// PutBlobStream copies src into a temporary file in the layout's blob
// directory while hashing it, and renames it into place only if its size and
// digest are desc's. A blob already present with the right size is left
// alone.
func (l *Layout) PutBlobStream(ctx context.Context, desc ocispec.Descriptor, src io.ReaderAt) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	if _, err := ParseDigest(string(desc.Digest)); err != nil {
		return errcode.Wrap(errcode.InvalidInput, err, "invalid blob digest %q", desc.Digest)
	}
	if desc.Size < 0 {
		return errcode.New(errcode.InvalidInput, "blob %s has a negative size %d", desc.Digest, desc.Size)
	}
	if err := l.ensureLayout(ctx); err != nil {
		return err
	}
	if fi, err := os.Stat(l.blobPath(desc.Digest)); err == nil && fi.Mode().IsRegular() && fi.Size() == desc.Size {
		return nil
	}
	dir, name := l.blobDir(), desc.Digest.Encoded()
	// 0644: layouts are read by other users and tools.
	f, err := atomicfile.Create(filepath.Join(dir, name), 0o644)
	if err != nil {
		return errcode.Wrap(errcode.RegistryError, err, "cannot write blob %s to %s; check that the directory is writable", desc.Digest, l.dir)
	}
	defer f.Abort()
	d := digest.SHA256.Digester()
	// One byte more than desc.Size is read, to tell a longer source.
	n, err := io.Copy(io.MultiWriter(f, d.Hash()), &ctxReader{ctx, io.NewSectionReader(src, 0, desc.Size+1)})
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return errcode.Wrap(errcode.RegistryError, err, "cannot write blob %s to %s", desc.Digest, l.dir)
	}
	if n != desc.Size {
		return errcode.New(errcode.DigestMismatch, "data for blob %s is %d bytes or more, not the %d its descriptor says", desc.Digest, n, desc.Size)
	}
	if got := d.Digest(); got != desc.Digest {
		return errcode.New(errcode.DigestMismatch, "data for blob %s has digest %s; the descriptor does not describe this data", desc.Digest, got)
	}
	if err = f.Commit(); err != nil {
		return errcode.Wrap(errcode.RegistryError, err, "cannot write blob %s to %s; check that the disk has space", desc.Digest, l.dir)
	}
	return nil
}

// ctxReader stops a copy when ctx ends.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c *ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
