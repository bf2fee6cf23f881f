package ociimage

// The registry client's blob reads: whether the repository holds a blob,
// and fetching one (or a manifest, by digest) bounded before a byte is read
// and verified before one is returned.

import (
	"context"
	"fmt"
	"net/http"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/internal/unhashed"
)

// HasBlob asks the registry (HEAD) whether the repository holds the blob.
func (r *Registry) HasBlob(ctx context.Context, d digest.Digest) (bool, error) {
	if _, err := ParseDigest(string(d)); err != nil {
		return false, errcode.Wrap(errcode.InvalidInput, err, "invalid blob digest %q", d)
	}
	if _, ok := r.known.Load(d); ok {
		return true, ctx.Err()
	}
	var have bool
	err := r.withRetry(ctx, "checking for blob "+string(d), 0, func(ctx context.Context) error {
		size, ok, err := r.headBlob(ctx, d)
		if err == nil && ok {
			r.remember(d, size)
		}
		have = ok
		return err
	})
	return have, err
}

// headBlob returns the blob's size (-1 if the registry does not say) and
// whether it exists.
func (r *Registry) headBlob(ctx context.Context, d digest.Digest) (int64, bool, error) {
	resp, err := r.send(ctx, http.MethodHead, r.url("blobs", string(d)), "")
	if err != nil {
		return 0, false, err
	}
	defer drain(resp)
	switch resp.StatusCode {
	case http.StatusOK:
		return resp.ContentLength, true, nil
	case http.StatusNotFound:
		return 0, false, nil
	}
	return 0, false, transport.CheckError(resp, http.StatusOK, http.StatusNotFound)
}

func (r *Registry) remember(d digest.Digest, size int64) { r.known.Store(d, size) }

// Blob fetches a whole blob, refusing one said to be larger than limit
// before a byte is read, and verifies its size and digest.
func (r *Registry) Blob(ctx context.Context, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	return r.fetch(ctx, "blob", desc, limit)
}

// BlobUnhashed is Blob checking the size alone, for a reader beneath
// ociimage that verifies the bytes itself (imgcrypt's Decrypt, see
// package unhashed).
func (r *Registry) BlobUnhashed(ctx context.Context, _ unhashed.Key, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	return r.fetchChecked(ctx, "blob", desc, limit, false)
}

func (r *Registry) fetch(ctx context.Context, what string, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	return r.fetchChecked(ctx, what, desc, limit, true)
}

func (r *Registry) fetchChecked(ctx context.Context, what string, desc ocispec.Descriptor, limit int64, hashed bool) ([]byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := checkFetch(what, desc, limit); err != nil {
		return nil, err
	}
	kind, accept := "blobs", ""
	if what == "manifest" || what == "index" {
		kind, accept = "manifests", manifestAccept
	}
	var out []byte
	err := r.withRetry(ctx, "fetching "+what+" "+string(desc.Digest), desc.Size, func(ctx context.Context) error {
		resp, err := r.send(ctx, http.MethodGet, r.url(kind, string(desc.Digest)), accept)
		if err != nil {
			return err
		}
		defer drain(resp)
		if resp.StatusCode == http.StatusNotFound {
			return errcode.New(errcode.RegistryError, "%s %s is missing from %s; the image is incomplete, push it again", what, desc.Digest, r.where())
		}
		if err := transport.CheckError(resp, http.StatusOK); err != nil {
			return err
		}
		corrupt := func(detail string) error {
			return errcode.New(errcode.DigestMismatch,
				"%s %s from %s does not match its digest (%s): the registry returned corrupt data; push the image again", what, desc.Digest, r.where(), detail)
		}
		if resp.ContentLength >= 0 && resp.ContentLength != desc.Size {
			return corrupt(fmt.Sprintf("the registry sends %d bytes, the %s has %d", resp.ContentLength, what, desc.Size))
		}
		// One byte more than expected tells a longer body from a right one.
		buf := make([]byte, desc.Size+1)
		n, err := readAll(resp.Body, buf)
		if err != nil {
			return err // cut off: worth another try
		}
		if int64(n) != desc.Size {
			return corrupt(fmt.Sprintf("got %d bytes or more, want %d", n, desc.Size))
		}
		if !hashed {
			out = buf[:n]
			return nil
		}
		if got := digest.FromBytes(buf[:n]); got != desc.Digest {
			return corrupt("got " + string(got))
		}
		out = buf[:n]
		return nil
	})
	if err != nil {
		return nil, err
	}
	if what == "blob" && hashed {
		r.remember(desc.Digest, desc.Size)
	}
	return out, nil
}
