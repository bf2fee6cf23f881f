package ociimage

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"strconv"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// MaxRangeSize bounds one ranged read: a frame of a RAM pack (2 MiB and
// its headers) with room to spare.
const MaxRangeSize = 16 << 20

// BlobRanger is an optional extension of Repository, found by type
// assertion (Layout, Registry): it reads n bytes of a blob from off.
// The bytes are NOT checked against the blob's digest, which covers the
// whole blob: the caller verifies them by a digest of its own (a RAM
// pack's frame has its SHA-256 in the index).
type BlobRanger interface {
	BlobRange(ctx context.Context, desc ocispec.Descriptor, off, n int64) ([]byte, error)
}

var (
	_ BlobRanger = (*Layout)(nil)
	_ BlobRanger = (*Registry)(nil)
)

// ReadBlobRange reads n bytes of the blob desc names from off, through
// repo's store (see BlobRanger). Through a wrapper that transforms reads (imgcrypt's decryption) it refuses: a range of
// an encrypted layer is ciphertext, which a later version will decrypt.
func ReadBlobRange(ctx context.Context, repo Repository, desc ocispec.Descriptor, off, n int64) ([]byte, error) {
	if TransformsReads(repo) {
		return nil, errcode.New(errcode.Usage, "blob %s: ranged reads of encrypted images are not supported yet; read the whole blob", desc.Digest)
	}
	r, ok := Underlying(repo).(BlobRanger)
	if !ok {
		return nil, errcode.New(errcode.Internal, "this store does not serve ranges of blobs")
	}
	return r.BlobRange(ctx, desc, off, n)
}

// checkRange refuses a range outside the blob or past MaxRangeSize.
func checkRange(desc ocispec.Descriptor, off, n int64) error {
	if err := checkFetch("blob", desc, MaxPackSize); err != nil {
		return err
	}
	if off < 0 || n <= 0 || n > MaxRangeSize || off > desc.Size-n {
		return errcode.New(errcode.InvalidInput, "bytes %d+%d of blob %s: outside its %d bytes, or more than %d at once", off, n, desc.Digest, desc.Size, MaxRangeSize)
	}
	return nil
}

// BlobRange reads n bytes of a blob file from off, after checking the
// file is a regular file of the blob's size.
func (l *Layout) BlobRange(ctx context.Context, desc ocispec.Descriptor, off, n int64) ([]byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := checkRange(desc, off, n); err != nil {
		return nil, err
	}
	f, fi, err := l.openFile(blobRel(desc.Digest))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, errcode.New(errcode.RegistryError, "blob %s is missing from %s; the image is incomplete, push it again", desc.Digest, l.dir)
	}
	if err != nil {
		return nil, errcode.Wrap(errcode.RegistryError, err, "cannot read blob %s in %s", desc.Digest, l.dir)
	}
	defer f.Close()
	if fi.Size() != desc.Size {
		return nil, errcode.New(errcode.DigestMismatch, "blob %s in %s is %d bytes, not %d: the layout is corrupt; push the image again", desc.Digest, l.dir, fi.Size(), desc.Size)
	}
	buf := make([]byte, n)
	if _, err := f.ReadAt(buf, off); err != nil {
		return nil, errcode.Wrap(errcode.RegistryError, err, "cannot read blob %s in %s", desc.Digest, l.dir)
	}
	return buf, nil
}

// BlobRange GETs n bytes of a blob from off with a Range header. A
// registry answers 206 with a Content-Range that must be the one asked
// for, of the blob's size. One that ignores the range answers 200 with
// the whole blob: the span is read out of it (at most off+n bytes read,
// the rest left unread).
func (r *Registry) BlobRange(ctx context.Context, desc ocispec.Descriptor, off, n int64) ([]byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := checkRange(desc, off, n); err != nil {
		return nil, err
	}
	var out []byte
	what := fmt.Sprintf("fetching bytes %d+%d of blob %s", off, n, desc.Digest)
	err := r.withRetry(ctx, what, n, func(ctx context.Context) error {
		resp, err := r.sendRange(ctx, r.url("blobs", string(desc.Digest)), off, n)
		if err != nil {
			return err
		}
		defer drain(resp)
		out, err = r.readRange(resp, desc, off, n)
		return err
	})
	return out, err
}

func (r *Registry) sendRange(ctx context.Context, url string, off, n int64) (*http.Response, error) {
	rt, err := r.transport(ctx)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "building a registry request")
	}
	req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", off, off+n-1))
	return (&http.Client{Transport: rt}).Do(req)
}

// readRange reads the span from a 206 (or a 200 that ignored the range).
func (r *Registry) readRange(resp *http.Response, desc ocispec.Descriptor, off, n int64) ([]byte, error) {
	if resp.StatusCode == http.StatusNotFound {
		return nil, errcode.New(errcode.RegistryError, "blob %s is missing from %s; the image is incomplete, push it again", desc.Digest, r.where())
	}
	if err := transport.CheckError(resp, http.StatusOK, http.StatusPartialContent); err != nil {
		return nil, err
	}
	bad := func(format string, args ...any) error {
		return errcode.New(errcode.RegistryError, "registry %s answered a range of blob %s with "+format+": refused", append([]any{r.where(), desc.Digest}, args...)...)
	}
	if resp.StatusCode == http.StatusOK {
		if resp.ContentLength >= 0 && resp.ContentLength != desc.Size {
			return nil, bad("the whole blob of %d bytes, not %d", resp.ContentLength, desc.Size)
		}
		if _, err := io.CopyN(io.Discard, resp.Body, off); err != nil {
			return nil, err
		}
	} else if got := resp.Header.Get("Content-Range"); got != contentRange(off, n, desc.Size) {
		return nil, bad("Content-Range %q, not %q", got, contentRange(off, n, desc.Size))
	} else if resp.ContentLength >= 0 && resp.ContentLength != n {
		return nil, bad("%d bytes, not %d", resp.ContentLength, n)
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(resp.Body, buf); err != nil {
		return nil, err // cut off: worth another try
	}
	return buf, nil
}

func contentRange(off, n, size int64) string {
	return "bytes " + strconv.FormatInt(off, 10) + "-" + strconv.FormatInt(off+n-1, 10) + "/" + strconv.FormatInt(size, 10)
}
