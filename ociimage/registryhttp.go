package ociimage

// The registry client's HTTP: URLs, the authenticating transports, one
// request, bounded reads of an answer, and the guard that keeps plain HTTP
// to the hosts named insecure.

import (
	"context"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

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
	return readAtMost(resp.Body, limit, func() error { return tooLarge(limit + 1) })
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
