package ociimage

// The registry client's blob uploads: one upload per digest at a time, each
// retried from its start, in two requests (POST, then PUT of the data).

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/url"
	"sync"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// PutBlob uploads data as it is (it is already compressed, and at most
// MaxChunkSize), from the slice: nothing is copied, and nothing is hashed
// again, because the registry hashes what it receives and refuses a body
// that does not match the digest (DIGEST_MISMATCH).
func (r *Registry) PutBlob(ctx context.Context, desc ocispec.Descriptor, data []byte) error {
	_, err := r.AddBlob(ctx, desc, data)
	return err
}

// AddBlob is PutBlob that also says whether the data was sent (false: the
// registry had the blob already). A chunk the registry lacks costs two
// requests and one it has costs one, where HasBlob then PutBlob would cost
// three and one.
func (r *Registry) AddBlob(ctx context.Context, desc ocispec.Descriptor, data []byte) (sent bool, err error) {
	if int64(len(data)) != desc.Size {
		return false, errcode.New(errcode.DigestMismatch, "data for blob %s is %d bytes, not the %d its descriptor says", desc.Digest, len(data), desc.Size)
	}
	return r.store(ctx, desc, bytes.NewReader(data))
}

// PutBlobStream uploads desc.Size bytes of src in two requests: a POST that
// opens an upload session, offering to mount the blob from this very
// repository (a registry that holds it answers 201 and nothing is sent),
// and one PUT with the whole body and its digest. The registry checks the
// digest when the upload completes; a mismatch fails it and nothing is
// stored. Each retry reads src again from the start.
func (r *Registry) PutBlobStream(ctx context.Context, desc ocispec.Descriptor, src io.ReaderAt) error {
	_, err := r.store(ctx, desc, src)
	return err
}

func (r *Registry) store(ctx context.Context, desc ocispec.Descriptor, src io.ReaderAt) (sent bool, err error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	if _, err := ParseDigest(string(desc.Digest)); err != nil {
		return false, errcode.Wrap(errcode.InvalidInput, err, "invalid blob digest %q", desc.Digest)
	}
	if desc.Size < 0 {
		return false, errcode.New(errcode.InvalidInput, "blob %s has a negative size %d", desc.Digest, desc.Size)
	}
	if size, ok := r.known.Load(desc.Digest); ok && (size.(int64) == desc.Size || size.(int64) < 0) {
		return false, nil
	}
	// Concurrent puts of one blob (a layer repeated in a manifest, put by
	// Copy's workers) go up once, under the first caller's context and from
	// its src: every caller waits for the end of that upload, so no src is
	// read after its PutBlob returned. (EncodeStream never puts a digest
	// twice itself.)
	v, err, _ := r.uploads.Do(string(desc.Digest), func() (any, error) {
		sent := false
		err := r.withRetry(ctx, "storing blob "+string(desc.Digest), desc.Size, func(ctx context.Context) error {
			var err error
			sent, err = r.upload(ctx, desc, src)
			// The registry hashed what we sent: the source is not the blob.
			var terr *transport.Error
			if errors.As(err, &terr) {
				for _, e := range terr.Errors {
					if e.Code == transport.DigestInvalidErrorCode {
						return errcode.Wrap(errcode.DigestMismatch, err,
							"the data the registry received for blob %s does not match its digest (it changed on its way, or it is not that blob): try again, and if it persists, check any proxy in between", desc.Digest)
					}
				}
			}
			return err
		})
		return sent, err
	})
	if err != nil {
		return false, err
	}
	r.remember(desc.Digest, desc.Size)
	return v.(bool), nil
}

// upload is one try of PutBlobStream; it says whether it sent the data.
func (r *Registry) upload(ctx context.Context, desc ocispec.Descriptor, src io.ReaderAt) (bool, error) {
	rt, err := r.pushTransport(ctx)
	if err != nil {
		return false, err
	}
	client := &http.Client{Transport: rt}
	start, err := url.Parse(r.url("blobs", "uploads/"))
	if err != nil {
		return false, errcode.Wrap(errcode.Internal, err, "building a registry request")
	}
	start.RawQuery = url.Values{"mount": {string(desc.Digest)}, "from": {r.ref.Repository}}.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, start.String(), http.NoBody)
	if err != nil {
		return false, errcode.Wrap(errcode.Internal, err, "building a registry request")
	}
	resp, err := client.Do(req)
	if err != nil {
		return false, err
	}
	if err := transport.CheckError(resp, http.StatusCreated, http.StatusAccepted); err != nil {
		drain(resp)
		return false, err
	}
	drain(resp)
	if resp.StatusCode == http.StatusCreated {
		return false, nil // mounted: the repository has it
	}
	loc, err := resp.Request.URL.Parse(resp.Header.Get("Location"))
	if err != nil || resp.Header.Get("Location") == "" {
		return false, errcode.New(errcode.RegistryError, "registry %s opened an upload without a usable Location (%q)", r.ref.Registry, resp.Header.Get("Location"))
	}
	q := loc.Query()
	q.Set("digest", string(desc.Digest))
	loc.RawQuery = q.Encode()
	// net/http may go on reading a body after it returned the answer (a
	// registry that refuses early), and callers reuse their buffers once
	// PutBlob returns: every body is fenced off when the request is over.
	var bodies []*fencedReader
	defer func() {
		for _, b := range bodies {
			b.fence()
		}
	}()
	body := func() (io.ReadCloser, error) {
		b := &fencedReader{r: io.NewSectionReader(src, 0, desc.Size)}
		bodies = append(bodies, b)
		return b, nil
	}
	req, err = http.NewRequestWithContext(ctx, http.MethodPut, loc.String(), nil)
	if err != nil {
		return false, errcode.Wrap(errcode.Internal, err, "building a registry request")
	}
	req.Body, _ = body()
	req.GetBody = body // a redirect sends the body again
	req.ContentLength = desc.Size
	req.Header.Set("Content-Type", "application/octet-stream")
	if resp, err = client.Do(req); err != nil {
		return false, err
	}
	defer drain(resp)
	return true, transport.CheckError(resp, http.StatusCreated)
}

// fencedReader reads r until fence is called, and nothing after.
type fencedReader struct {
	mu     sync.Mutex
	r      io.Reader
	fenced bool
}

func (f *fencedReader) Read(p []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fenced {
		return 0, errors.New("the request this body belonged to is over")
	}
	return f.r.Read(p)
}

func (f *fencedReader) Close() error { return nil }

func (f *fencedReader) fence() {
	f.mu.Lock()
	f.fenced = true
	f.mu.Unlock()
}
