package ociimage

import (
	"context"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Option tunes how Open reaches a registry. Layout references ignore them.
type Option func(*openOptions)

type openOptions struct {
	configDir string   // Docker config directory; "" means $DOCKER_CONFIG, else ~/.docker
	caFiles   []string // PEM files of extra trusted CAs
	insecure  []string // HOST[:PORT] reached over plain HTTP
	attempts  int      // tries of one request before giving up
	backoff   time.Duration
	userAgent string
	sign      *SignKey    // manifests written are signed (Sign)
	verify    []VerifyKey // manifests resolved must be signed (VerifySignature)
	wrap      Wrapper     // layers are encrypted and decrypted (imgcrypt)
}

// Defaults of the retry policy: four tries of every request, 0.5 s, 1.5 s and
// 4.5 s apart (with jitter).
const (
	DefaultAttempts = 4
	DefaultBackoff  = 500 * time.Millisecond
)

// WithRegistryConfig names the Docker config directory that holds registry
// credentials: DIR/config.json ("auths"), or DIR/.dockerconfigjson as a
// Kubernetes dockerconfigjson secret is mounted. Without it, $DOCKER_CONFIG,
// else ~/.docker is read if present. Credential helpers are not run.
func WithRegistryConfig(dir string) Option {
	return func(o *openOptions) { o.configDir = dir }
}

// WithCAFile adds the CA certificates in a PEM file to the system's roots
// for registry TLS. It may be given more than once.
func WithCAFile(path string) Option {
	return func(o *openOptions) { o.caFiles = append(o.caFiles, path) }
}

// WithInsecureRegistry allows plain HTTP to exactly this HOST[:PORT]. Every
// other registry is reached over verified TLS only. It may be given more than
// once.
func WithInsecureRegistry(host string) Option {
	return func(o *openOptions) { o.insecure = append(o.insecure, host) }
}

// WithRetry sets how often one registry request (a blob, a manifest, one
// check) is tried when it fails transiently (5xx, 429, a reset or refused
// connection), and the first pause between tries; each pause is three times
// the last. attempts 1 turns retries off.
func WithRetry(attempts int, backoff time.Duration) Option {
	return func(o *openOptions) {
		o.attempts = max(attempts, 1)
		o.backoff = max(backoff, 0)
	}
}

// WithUserAgent names the program in the User-Agent of registry requests.
func WithUserAgent(ua string) Option {
	return func(o *openOptions) { o.userAgent = ua }
}

// Open returns the repository ref names. It does not touch the store: a
// layout directory is created by the first write, and a registry is first
// contacted by the first request (CheckAccess makes one on purpose). For a
// registry it reads the credentials and CA files now, so a bad option fails
// here.
func Open(ctx context.Context, ref Reference, opts ...Option) (Repository, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	o := openOptions{attempts: DefaultAttempts, backoff: DefaultBackoff, userAgent: "vmsnap"}
	for _, opt := range opts {
		opt(&o)
	}
	var repo Repository
	switch {
	case ref.IsLayout():
		repo = &Layout{ref: ref, dir: ref.Layout}
	case ref.Registry != "":
		r, err := openRegistry(ref, o)
		if err != nil {
			return nil, err
		}
		repo = r
	default:
		return nil, errcode.New(errcode.InvalidInput, "empty image reference; %s", referenceForms)
	}
	// Signatures are of the manifests as stored: under the encryption,
	// which rewrites a manifest's layers before storing it.
	if len(o.verify) > 0 {
		repo = &verifying{Repository: repo, keys: o.verify}
	}
	if o.sign != nil {
		repo = &signing{Repository: repo, key: *o.sign}
	}
	if o.wrap != nil {
		return o.wrap.Wrap(repo)
	}
	return repo, nil
}

// CheckAccess makes one authenticated request to the store, so that wrong
// credentials (AUTH_FAILED), an unknown CA or an unreachable registry
// (REGISTRY_ERROR) are reported before any work starts, for instance before
// a VM is stopped. A layout needs no such check.
func CheckAccess(ctx context.Context, repo Repository) error {
	if r, ok := Underlying(repo).(*Registry); ok {
		return r.checkAccess(ctx)
	}
	return ctx.Err()
}
