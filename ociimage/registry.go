package ociimage

// The registry client: the Registry type, how Open makes one, and the one
// request that checks access. Its other concerns are in registry*.go.

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"golang.org/x/sync/singleflight"

	"github.com/vmsnap/vmsnap/internal/errcode"
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
