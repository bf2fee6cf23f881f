package ociimage

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"mime"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sync/singleflight"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/internal/unhashed"
)

// Registry is a Repository in a repository of an OCI registry
// (HOST[:PORT]/REPO), spoken to with the distribution API through
// go-containerregistry: its authenticating transports (Basic or Bearer, as
// the registry's challenge asks) and its Pusher for blob uploads and manifest
// puts (which keeps the referrers tag fallback). Reads are done here, so that
// every one is bounded before a byte is read and verified before it is
// returned.
//
// Every request is tried again on transient failures (5xx, 429, reset or
// refused connections, timeouts) with backoff, each blob on its own; the
// context reaches every request. A Registry is safe for concurrent use and
// holds no blob beyond the call that passed it in.
type Registry struct {
	ref      Reference
	repo     name.Repository
	creds    credentials
	base     http.RoundTripper // TLS, the plain-HTTP guard, User-Agent; no auth
	pusher   *remote.Pusher
	attempts int
	backoff  time.Duration
	tryBase  time.Duration // a request's time limit before its transfer (tests shorten it)
	insecure bool          // plain HTTP allowed (WithInsecureRegistry)

	mu     sync.Mutex
	rt     http.RoundTripper // authenticated for pulls; set by the first request
	pushRT http.RoundTripper // authenticated for pushes; set by the first upload
	// deleteRT is authenticated for deletes (retention); set by the first.
	deleteRT http.RoundTripper

	// known holds the blobs this Registry has seen in the repository
	// (digest -> size), so that a chunk repeated in a stream (zero pages)
	// is checked once, and PutManifest need not ask again.
	known sync.Map
	// uploads collapses concurrent puts of one digest into one upload.
	uploads singleflight.Group
}

var _ Repository = (*Registry)(nil)

// Media types a manifest GET or HEAD accepts. vmsnap reads only OCI image
// manifests, but asking for the others gets a clear "this is a container
// image index" instead of a registry's MANIFEST_UNKNOWN.
var manifestAccept = strings.Join([]string{
	ocispec.MediaTypeImageManifest, ocispec.MediaTypeImageIndex,
	string(types.DockerManifestSchema2), string(types.DockerManifestList),
}, ", ")

func openRegistry(ref Reference, o openOptions) (*Registry, error) {
	insecure := map[string]bool{}
	for _, h := range o.insecure {
		h = strings.ToLower(strings.TrimSpace(h))
		if !hostRE.MatchString(h) {
			return nil, errcode.New(errcode.Usage, "%s %q is not HOST[:PORT]", errcode.Field("insecureRegistry"), h)
		}
		insecure[h] = true
	}
	roots, err := x509.SystemCertPool()
	if err != nil || roots == nil {
		roots = x509.NewCertPool()
	}
	for _, f := range o.caFiles {
		pem, err := readLimited(f, 4<<20)
		if err != nil {
			return nil, errcode.Wrap(errcode.Usage, err, "cannot read the CA file %s given with %s", f, errcode.Field("caFile"))
		}
		if !roots.AppendCertsFromPEM(pem) {
			return nil, errcode.New(errcode.Usage, "the CA file %s holds no PEM certificate", f)
		}
	}
	creds, err := loadCredentials(o.configDir, ref.Registry)
	if err != nil {
		return nil, err
	}
	var nameOpts []name.Option
	allowHTTP := insecure[strings.ToLower(ref.Registry)]
	if allowHTTP {
		nameOpts = append(nameOpts, name.Insecure)
	}
	repo, err := name.NewRepository(ref.Registry+"/"+ref.Repository, nameOpts...)
	if err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "invalid registry reference %s", ref)
	}

	guard := &plainHTTPGuard{allowed: insecure, inner: &http.Transport{
		Proxy:                 http.ProxyFromEnvironment,
		DialContext:           (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSClientConfig:       &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
		TLSHandshakeTimeout:   15 * time.Second,
		ResponseHeaderTimeout: 2 * time.Minute,
		ExpectContinueTimeout: time.Second,
		// HTTP/1.1: each chunk in flight gets its own connection (no
		// head-of-line blocking behind one TCP window), and enough of them
		// stay open for all the workers.
		MaxIdleConns:        128,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
	}}
	pusher, err := remote.NewPusher(
		remote.WithTransport(guard),
		remote.WithAuth(creds.auth),
		remote.WithUserAgent(o.userAgent),
		// Retries are ours (withRetry), one policy for every request.
		remote.WithRetryBackoff(remote.Backoff{Steps: 1}),
		remote.WithRetryStatusCodes(),
		remote.WithRetryPredicate(func(error) bool { return false }),
		remote.WithReferrersTagFallback(true),
	)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "setting up the registry client")
	}
	return &Registry{
		ref: ref, repo: repo, creds: creds,
		base:   transport.NewUserAgent(guard, o.userAgent),
		pusher: pusher, attempts: o.attempts, backoff: o.backoff, insecure: allowHTTP,
	}, nil
}

// Reference is what the repository was opened from.
func (r *Registry) Reference() Reference { return r.ref }

func (r *Registry) where() string { return r.ref.Registry + "/" + r.ref.Repository }

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

// PutManifest pushes the manifest's exact bytes with its media type, by
// digest: no tag moves (TagManifest does that). Like a layout it refuses a
// manifest whose blobs the registry does not hold. A manifest with a subject
// is listed among the subject's referrers: by the registry if it has the
// referrers API, else in the sha256-HEX tag (the referrers tag schema).
func (r *Registry) PutManifest(ctx context.Context, m ocispec.Manifest) (ocispec.Descriptor, error) {
	if err := ctx.Err(); err != nil {
		return ocispec.Descriptor{}, err
	}
	m, b, desc, err := encodeManifest(m)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	if r.ref.IsDigest() {
		return ocispec.Descriptor{}, errcode.New(errcode.InvalidInput,
			"cannot store a manifest at %s: a digest reference names an existing manifest; push to %s or %s:TAG", r.ref, r.where(), r.where())
	}
	if err := r.checkBlobs(ctx, m); err != nil {
		return ocispec.Descriptor{}, err
	}
	target := r.repo.Digest(desc.Digest.String())
	raw := rawManifest{data: b, mediaType: types.MediaType(desc.MediaType)}
	err = r.withRetry(ctx, "storing the manifest "+string(desc.Digest), desc.Size, func(ctx context.Context) error {
		return r.pusher.Put(ctx, target, raw)
	})
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	return desc, nil
}

// checkBlobs makes sure every blob the manifest names is in the repository,
// asking only about those this Registry has not seen.
func (r *Registry) checkBlobs(ctx context.Context, m ocispec.Manifest) error {
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(8)
	for i, bd := range append([]ocispec.Descriptor{m.Config}, m.Layers...) {
		what := "config"
		if i > 0 {
			what = fmt.Sprintf("layer %d", i-1)
		}
		g.Go(func() error {
			return errcode.Safely(func() error { // the registry's answers are untrusted
				size, ok := r.known.Load(bd.Digest)
				if !ok {
					var have bool
					err := r.withRetry(gctx, "checking for blob "+string(bd.Digest), 0, func(ctx context.Context) error {
						var err error
						var n int64
						n, have, err = r.headBlob(ctx, bd.Digest)
						size = n
						return err
					})
					if err != nil {
						return err
					}
					if !have {
						return errcode.New(errcode.RegistryError,
							"refusing to store the manifest: its %s blob %s is not in %s; store every blob before the manifest", what, bd.Digest, r.where())
					}
					r.remember(bd.Digest, size.(int64))
				}
				if n := size.(int64); n >= 0 && n != bd.Size {
					return errcode.New(errcode.DigestMismatch,
						"refusing to store the manifest: its %s blob %s in %s is %d bytes, not the %d the manifest says", what, bd.Digest, r.where(), n, bd.Size)
				}
				return nil
			})
		})
	}
	return g.Wait()
}

// Resolve returns the descriptor of the manifest the reference names: HEAD,
// and a GET where the registry's HEAD does not tell enough.
func (r *Registry) Resolve(ctx context.Context) (ocispec.Descriptor, error) {
	return r.resolveRef(ctx, r.ref)
}

// ResolveTag is Repository.ResolveTag.
func (r *Registry) ResolveTag(ctx context.Context, tag string) (ocispec.Descriptor, error) {
	return r.resolveRef(ctx, r.ref.WithTag(tag))
}

// resolveRef is Resolve for ref, a reference into this repository.
func (r *Registry) resolveRef(ctx context.Context, ref Reference) (ocispec.Descriptor, error) {
	if err := ctx.Err(); err != nil {
		return ocispec.Descriptor{}, err
	}
	ident, what := ref.Tag, "resolving tag "+ref.Tag
	switch {
	case ref.IsDigest():
		ident, what = string(ref.Digest), "resolving manifest "+string(ref.Digest)
	case ref.Tag == "":
		return ocispec.Descriptor{}, errcode.New(errcode.InvalidInput,
			"%s names neither a tag nor a digest; use %s:TAG or %s@sha256:HEX", ref, ref, ref)
	}
	var desc ocispec.Descriptor
	err := r.withRetry(ctx, what, 0, func(ctx context.Context) error {
		var err error
		desc, err = r.resolve(ctx, ident, ref.Digest)
		return err
	})
	return desc, err
}

// resolve describes the manifest ident (a tag, or the digest want) names.
func (r *Registry) resolve(ctx context.Context, ident string, want digest.Digest) (ocispec.Descriptor, error) {
	resp, err := r.send(ctx, http.MethodHead, r.url("manifests", ident), manifestAccept)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	drain(resp)
	switch resp.StatusCode {
	case http.StatusOK:
		d, derr := ParseDigest(resp.Header.Get("Docker-Content-Digest"))
		mt := mediaType(resp.Header.Get("Content-Type"))
		switch {
		case want != "" && derr == nil && d != want:
			return ocispec.Descriptor{}, errcode.New(errcode.DigestMismatch,
				"registry %s answers manifest %s with digest %s", r.ref.Registry, want, d)
		case want != "":
			d, derr = want, nil
		}
		if derr == nil && mt != "" && resp.ContentLength >= 0 {
			if resp.ContentLength > MaxManifestSize {
				return ocispec.Descriptor{}, tooLargeManifest(ident, resp.ContentLength)
			}
			return ocispec.Descriptor{MediaType: mt, Digest: d, Size: resp.ContentLength}, nil
		}
	case http.StatusNotFound:
		return ocispec.Descriptor{}, r.notFound(ident, want != "")
	case http.StatusUnauthorized, http.StatusForbidden:
		return ocispec.Descriptor{}, transport.CheckError(resp, http.StatusOK)
	}
	// The HEAD did not say enough (no digest or length, or a registry that
	// does not answer HEAD): fetch the manifest and describe it.
	resp, err = r.send(ctx, http.MethodGet, r.url("manifests", ident), manifestAccept)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	defer drain(resp)
	if resp.StatusCode == http.StatusNotFound {
		return ocispec.Descriptor{}, r.notFound(ident, want != "")
	}
	if err := transport.CheckError(resp, http.StatusOK); err != nil {
		return ocispec.Descriptor{}, err
	}
	b, err := readBounded(resp, MaxManifestSize, func(n int64) error { return tooLargeManifest(ident, n) })
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	d := digest.FromBytes(b)
	if hdr := resp.Header.Get("Docker-Content-Digest"); (want != "" && d != want) || (hdr != "" && hdr != string(d)) {
		return ocispec.Descriptor{}, errcode.New(errcode.DigestMismatch,
			"the manifest %s from registry %s has digest %s; the registry returned corrupt data", ident, r.ref.Registry, d)
	}
	mt := mediaType(resp.Header.Get("Content-Type"))
	if mt == "" {
		var head struct {
			MediaType string `json:"mediaType"`
		}
		_ = json.Unmarshal(b, &head)
		mt = head.MediaType
	}
	return ocispec.Descriptor{MediaType: mt, Digest: d, Size: int64(len(b))}, nil
}

func (r *Registry) notFound(ident string, isDigest bool) error {
	if isDigest {
		return notFound{errcode.New(errcode.RegistryError, "no manifest %s in %s; check the digest, or use a tag", ident, r.where())}
	}
	return notFound{errcode.New(errcode.RegistryError, "no tag %s in %s", ident, r.where())}
}

func tooLargeManifest(what string, n int64) error {
	return errcode.New(errcode.InvalidInput, "%s is %d bytes, more than the %d a manifest may have; it was not written by vmsnap", what, n, MaxManifestSize)
}

// Manifest fetches the manifest desc names by digest, verifies it and
// parses it.
func (r *Registry) Manifest(ctx context.Context, desc ocispec.Descriptor) (ocispec.Manifest, error) {
	if desc.MediaType != "" && desc.MediaType != ocispec.MediaTypeImageManifest {
		return ocispec.Manifest{}, errcode.New(errcode.InvalidInput,
			"%s in %s is a %s, not an image manifest; vmsnap reads only the image manifests it writes", desc.Digest, r.where(), desc.MediaType)
	}
	b, err := r.fetch(ctx, "manifest", desc, MaxManifestSize)
	if err != nil {
		return ocispec.Manifest{}, err
	}
	m, err := decodeManifest(b)
	if err != nil {
		return ocispec.Manifest{}, errcode.Wrap(errcode.InvalidInput, err, "%s in %s", desc.Digest, r.where())
	}
	return m, nil
}

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

// Referrers lists the manifests whose subject is desc: through the
// registry's referrers API, or where it has none (distribution 2.8) the
// image index tagged sha256-HEX that writers keep instead.
func (r *Registry) Referrers(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if _, err := ParseDigest(string(desc.Digest)); err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "invalid manifest digest %q", desc.Digest)
	}
	var out []ocispec.Descriptor
	err := r.withRetry(ctx, "listing the referrers of "+string(desc.Digest), 0, func(ctx context.Context) error {
		var err error
		out, err = r.referrers(ctx, desc.Digest)
		return err
	})
	return out, err
}

func (r *Registry) referrers(ctx context.Context, d digest.Digest) ([]ocispec.Descriptor, error) {
	tooLarge := func(n int64) error {
		return errcode.New(errcode.InvalidInput, "the referrers list of %s in %s is %d bytes, more than the %d vmsnap reads", d, r.where(), n, MaxIndexSize)
	}
	resp, err := r.send(ctx, http.MethodGet, r.url("referrers", string(d)), ocispec.MediaTypeImageIndex)
	if err != nil {
		return nil, err
	}
	defer drain(resp)
	var b []byte
	switch {
	case resp.StatusCode == http.StatusOK && mediaType(resp.Header.Get("Content-Type")) == ocispec.MediaTypeImageIndex:
		if b, err = readBounded(resp, MaxIndexSize, tooLarge); err != nil {
			return nil, err
		}
	case resp.StatusCode == http.StatusOK, resp.StatusCode == http.StatusNotFound, resp.StatusCode == http.StatusBadRequest,
		resp.StatusCode == http.StatusMethodNotAllowed, resp.StatusCode == http.StatusNotAcceptable:
		// No referrers API: the tag schema.
		tag := strings.Replace(string(d), ":", "-", 1)
		fresp, err := r.send(ctx, http.MethodGet, r.url("manifests", tag), ocispec.MediaTypeImageIndex)
		if err != nil {
			return nil, err
		}
		defer drain(fresp)
		if fresp.StatusCode == http.StatusNotFound {
			return nil, nil
		}
		if err := transport.CheckError(fresp, http.StatusOK); err != nil {
			return nil, err
		}
		if b, err = readBounded(fresp, MaxIndexSize, tooLarge); err != nil {
			return nil, err
		}
	default:
		return nil, transport.CheckError(resp, http.StatusOK)
	}
	var idx ocispec.Index
	if err := json.Unmarshal(b, &idx); err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "the referrers list of %s in %s is not an image index", d, r.where())
	}
	var out []ocispec.Descriptor
	for _, e := range idx.Manifests {
		if _, err := ParseDigest(string(e.Digest)); err == nil && e.Size >= 0 {
			out = append(out, e)
		}
	}
	return out, nil
}

// checkAccess makes one authenticated request (GET /v2/).
func (r *Registry) checkAccess(ctx context.Context) error {
	return r.withRetry(ctx, "checking access", 0, func(ctx context.Context) error {
		resp, err := r.send(ctx, http.MethodGet, r.scheme()+"://"+r.ref.Registry+"/v2/", "")
		if err != nil {
			return err
		}
		defer drain(resp)
		return transport.CheckError(resp, http.StatusOK)
	})
}

// --- HTTP ---

// scheme is where requests start; the transport moves them to the scheme
// the registry answered its first request on (HTTPS is tried first even for
// an insecure registry).
func (r *Registry) scheme() string {
	if r.insecure {
		return "http"
	}
	return "https"
}

func (r *Registry) url(kind, ident string) string {
	return fmt.Sprintf("%s://%s/v2/%s/%s/%s", r.scheme(), r.ref.Registry, r.ref.Repository, kind, ident)
}

// transport returns the authenticated transport for reads, pinging the
// registry for its auth challenge on first use. A failure is not kept: the
// next request tries again.
func (r *Registry) transport(ctx context.Context) (http.RoundTripper, error) {
	return r.authTransport(ctx, &r.rt, transport.PullScope)
}

// pushTransport is transport's counterpart for uploads, with push scope.
func (r *Registry) pushTransport(ctx context.Context) (http.RoundTripper, error) {
	return r.authTransport(ctx, &r.pushRT, transport.PushScope)
}

func (r *Registry) authTransport(ctx context.Context, cached *http.RoundTripper, scope string) (http.RoundTripper, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if *cached != nil {
		return *cached, nil
	}
	rt, err := transport.NewWithContext(ctx, r.repo.Registry, r.creds.auth, r.base, []string{r.repo.Scope(scope)})
	if err != nil {
		return nil, err
	}
	*cached = rt
	return rt, nil
}

func (r *Registry) send(ctx context.Context, method, url, accept string) (*http.Response, error) {
	rt, err := r.transport(ctx)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, method, url, nil)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "building a registry request")
	}
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	return (&http.Client{Transport: rt}).Do(req)
}

// drain reads a little of what is left of a body, so the connection can be
// used again, and closes it.
func drain(resp *http.Response) {
	_, _ = io.CopyN(io.Discard, resp.Body, 64<<10)
	resp.Body.Close()
}

// readBounded reads a whole response body of at most limit bytes, refusing
// a longer one (tooLarge) before reading it if its length is announced.
func readBounded(resp *http.Response, limit int64, tooLarge func(int64) error) ([]byte, error) {
	if resp.ContentLength > limit {
		return nil, tooLarge(resp.ContentLength)
	}
	var buf bytes.Buffer
	n, err := io.Copy(&buf, io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return nil, err
	}
	if n > limit {
		return nil, tooLarge(n)
	}
	return buf.Bytes(), nil
}

// readAll fills buf from r until r ends. A clean end gives the byte count;
// a body cut off (io.ErrUnexpectedEOF, a reset) gives the error, so that the
// caller can tell a short blob from a broken connection.
func readAll(r io.Reader, buf []byte) (int, error) {
	n := 0
	for n < len(buf) {
		m, err := r.Read(buf[n:])
		n += m
		if err == io.EOF {
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

func mediaType(contentType string) string {
	if contentType == "" {
		return ""
	}
	mt, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		return ""
	}
	return mt
}

// plainHTTPGuard refuses every request that is not HTTPS, except to the
// hosts named with WithInsecureRegistry. go-containerregistry would fall back
// to plain HTTP on its own for localhost and private addresses (and send
// credentials that way); vmsnap does so only when told.
type plainHTTPGuard struct {
	allowed map[string]bool
	inner   http.RoundTripper
}

func (g *plainHTTPGuard) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme != "https" && !g.allowed[strings.ToLower(req.URL.Host)] {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, &plainHTTPRefused{host: req.URL.Host}
	}
	resp, err := g.inner.RoundTrip(req)
	noteRetryAfter(resp)
	return resp, err
}

type plainHTTPRefused struct{ host string }

func (e *plainHTTPRefused) Error() string {
	return "refusing plain HTTP to " + e.host + " (allow it with --insecure-registry " + e.host + ")"
}

// --- retries and errors ---

// withRetry runs op, trying again with backoff while it fails transiently,
// and turns its final error into a coded one that says what failed.
func (r *Registry) withRetry(ctx context.Context, what string, size int64, op func(context.Context) error) error {
	delay := r.backoff
	limit := r.tryLimit(size)
	for try := 1; ; try++ {
		// Each try has a deadline of its own: a registry that accepts a
		// request and then stops answering must not hold a checkpoint (and
		// its stopped VM) until the caller's overall timeout.
		tctx, cancel := context.WithTimeoutCause(ctx, limit, errStalled)
		tctx, hint := withRetryHint(tctx)
		err := op(tctx)
		stalled := ctx.Err() == nil && context.Cause(tctx) == errStalled
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return r.interrupted(ctx, what)
		}
		if stalled {
			if try >= r.attempts {
				return errcode.New(errcode.RegistryError, "%s: registry %s stopped answering (no answer within %v, %d tries); check the registry and the network in between",
					what, r.ref.Registry, limit.Round(time.Second), try)
			}
		} else if try >= r.attempts || !retryable(err) {
			return r.describe(ctx, what, err, try)
		}
		// ±20% jitter, so workers that failed together do not retry together.
		pause := time.Duration(float64(delay) * (0.8 + 0.4*rand.Float64()))
		if wait, ok := hint.get(); ok {
			if !waitFits(ctx, wait) {
				return r.askedToWait(what, err, wait)
			}
			pause = max(pause, wait)
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return r.interrupted(ctx, what)
		case <-t.C:
		}
		delay = min(delay*3, 30*time.Second)
	}
}

// interrupted is the error of a request the caller's context ended: a
// registry error (that is what we were waiting for), wrapping the context's
// error so that callers still see a cancellation or a deadline.
func (r *Registry) interrupted(ctx context.Context, what string) error {
	return errcode.Wrap(errcode.RegistryError, ctx.Err(), "%s: registry %s had not answered when the caller stopped waiting", what, r.ref.Registry)
}

// errStalled is the cause of a try that ran out of its own time.
var errStalled = errors.New("the registry stopped answering")

// tryLimit is how long one request moving size bytes may take: a base for
// the round trips plus the transfer at a slow 1 MiB/s.
func (r *Registry) tryLimit(size int64) time.Duration {
	base := r.tryBase
	if base == 0 {
		base = 20 * time.Second
	}
	return base + time.Duration(size>>20)*time.Second
}

// retryable tells transient failures from those another try cannot fix.
func retryable(err error) bool {
	var coded *errcode.Error
	if errors.As(err, &coded) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var terr *transport.Error
	if errors.As(err, &terr) {
		switch terr.StatusCode {
		case http.StatusRequestTimeout, http.StatusTooManyRequests, http.StatusInternalServerError,
			http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
			return true
		case http.StatusUnauthorized, http.StatusForbidden, http.StatusNotFound:
			return false
		}
		return terr.Temporary()
	}
	if tlsVerifyError(err) != nil || plainHTTPAnswer(err) {
		return false
	}
	if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNABORTED) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
		return true
	}
	var dnsErr *net.DNSError
	if errors.As(err, &dnsErr) {
		return dnsErr.IsTemporary || dnsErr.IsTimeout
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// tlsVerifyError returns the certificate verification failure in err, if
// that is what err is.
func tlsVerifyError(err error) error {
	var cve *tls.CertificateVerificationError
	if errors.As(err, &cve) {
		return cve
	}
	var ua x509.UnknownAuthorityError
	var he x509.HostnameError
	var ci x509.CertificateInvalidError
	switch {
	case errors.As(err, &ua):
		return ua
	case errors.As(err, &he):
		return he
	case errors.As(err, &ci):
		return ci
	}
	return nil
}

// plainHTTPAnswer reports whether a TLS request got a plain HTTP answer.
func plainHTTPAnswer(err error) bool {
	return strings.Contains(err.Error(), "server gave HTTP response to HTTPS client")
}

// describe gives err a code and a message that says what failed, what the
// registry said, and what to do about it. It never includes credentials:
// only where they came from.
func (r *Registry) describe(ctx context.Context, what string, err error, tries int) error {
	var coded *errcode.Error
	if errors.As(err, &coded) {
		return err
	}
	host := r.ref.Registry
	gaveUp := ""
	if tries > 1 {
		gaveUp = fmt.Sprintf(" (gave up after %d tries)", tries)
	}
	var terr *transport.Error
	if errors.As(err, &terr) {
		words := registryWords(terr)
		if terr.StatusCode == http.StatusUnauthorized || terr.StatusCode == http.StatusForbidden {
			if len(terr.Errors) == 0 {
				// A HEAD has no body: ask for the registry's words.
				if w := r.authWords(ctx); w != "" {
					words = w
				}
			}
			return errcode.New(errcode.AuthFailed, "%s: registry %s refused access to %s: %s; vmsnap used %s: check the credentials, and that they may %s %s",
				what, host, r.ref.Repository, words, r.creds.where, accessFor(terr), r.ref.Repository)
		}
		return errcode.New(errcode.RegistryError, "%s: registry %s answered %s%s%s", what, host, words, gaveUp, statusAdvice(terr.StatusCode))
	}
	if cve := tlsVerifyError(err); cve != nil {
		return errcode.New(errcode.RegistryError,
			"%s: cannot verify the TLS certificate of registry %s: %v; if the registry uses a private CA, pass the CA's certificate with %s", what, host, cve, errcode.Field("caFile"))
	}
	if plainHTTPAnswer(err) {
		return errcode.New(errcode.RegistryError,
			"%s: registry %s answers plain HTTP, not TLS; if that is intended, pass %s %s", what, host, errcode.Field("insecureRegistry"), host)
	}
	failed, advice := unreachable(err, host)
	return errcode.Wrap(errcode.RegistryError, withAdvice{withoutRefusals{err}, advice}, "%s: %s%s", what, failed, gaveUp)
}

// withoutRefusals drops from err's text the plain-HTTP attempts the guard
// refused when go-containerregistry's ping tried both schemes: the HTTPS
// failure is the one that matters, and "use --insecure-registry" would be
// bad advice for a registry that is down.
type withoutRefusals struct{ err error }

func (w withoutRefusals) Unwrap() error { return w.err }

func (w withoutRefusals) Error() string {
	parts := strings.Split(w.err.Error(), "; ")
	kept := parts[:0]
	for _, p := range parts {
		if !strings.Contains(p, "refusing plain HTTP to") {
			kept = append(kept, p)
		}
	}
	if len(kept) == 0 {
		return w.err.Error()
	}
	return strings.Join(kept, "; ")
}

// registryWords is the registry's own account of a failed request: its
// status and error codes and messages.
func registryWords(terr *transport.Error) string {
	status := fmt.Sprintf("%d %s", terr.StatusCode, http.StatusText(terr.StatusCode))
	if len(terr.Errors) == 0 {
		// The message after "METHOD URL: ", which quotes a short body.
		msg := terr.Error()
		if terr.Request != nil {
			if _, rest, ok := strings.Cut(msg, ": "); ok {
				msg = rest
			}
		}
		if len(msg) > 300 {
			msg = msg[:300] + "..."
		}
		return msg
	}
	var parts []string
	for _, d := range terr.Errors {
		p := string(d.Code)
		if d.Message != "" {
			p += ": " + d.Message
		}
		if s, ok := d.Detail.(string); ok && s != "" {
			p += " (" + s + ")"
		}
		parts = append(parts, p)
	}
	return status + " (" + strings.Join(parts, "; ") + ")"
}

// authWords asks the registry's base endpoint for its words after a HEAD
// was refused.
func (r *Registry) authWords(ctx context.Context) string {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := r.send(ctx, http.MethodGet, r.scheme()+"://"+r.ref.Registry+"/v2/", "")
	if err != nil {
		return ""
	}
	defer drain(resp)
	var terr *transport.Error
	if errors.As(transport.CheckError(resp, http.StatusOK), &terr) && len(terr.Errors) > 0 {
		return registryWords(terr)
	}
	return ""
}

// --- go-containerregistry adapters ---

// rawManifest is a manifest pushed byte for byte, with its media type.
type rawManifest struct {
	data      []byte
	mediaType types.MediaType
}

func (m rawManifest) RawManifest() ([]byte, error)        { return m.data, nil }
func (m rawManifest) MediaType() (types.MediaType, error) { return m.mediaType, nil }
