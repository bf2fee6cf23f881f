package ociimage

import (
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// What a registry's failure means for the user, and what to do about it:
// the words describe adds to the registry's own. The table of registry
// failures in docs/errors-and-guarantees.md lists them.

// statusAdvice is what to do about a registry's answer with this status
// (other than 401 and 403, which are AUTH_FAILED).
func statusAdvice(status int) string {
	switch {
	case status == http.StatusTooManyRequests:
		return "; the registry limits how often it may be asked: try again later"
	case status == http.StatusNotFound:
		return "; check the registry, the repository and the reference"
	case status >= 500:
		return "; the registry is failing: try again later, or ask its operator"
	}
	return ""
}

// accessFor is what a refused request needed the credentials for.
func accessFor(terr *transport.Error) string {
	if terr.Request == nil {
		return "use"
	}
	switch terr.Request.Method {
	case http.MethodGet, http.MethodHead:
		return "pull from"
	case http.MethodDelete:
		return "delete from"
	}
	return "push to"
}

// unreachable says what went wrong with a request that got no answer from
// the registry at host, and what to do about it.
func unreachable(err error, host string) (failed, advice string) {
	var dnsErr *net.DNSError
	var record tls.RecordHeaderError
	switch {
	case errors.As(err, &dnsErr):
		return "cannot find registry " + host,
			"check the registry's name in the reference, and this host's DNS"
	case errors.As(err, &record) || strings.Contains(err.Error(), "malformed HTTP"):
		return "registry " + host + " does not answer as a registry (neither TLS nor HTTP)",
			"check the registry's address and port in the reference"
	// net.ErrClosed: the client's own end, closed under a write once the
	// registry had dropped the connection (seen on a loaded machine).
	case errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) || errors.Is(err, net.ErrClosed):
		return "registry " + host + " closed the connection mid-transfer",
			"if this persists, check the registry and the network in between"
	}
	return "cannot reach registry " + host,
		"check that the registry runs at that address and that this host can reach it"
}

// withAdvice is an error followed by what to do about it.
type withAdvice struct {
	err    error
	advice string
}

func (w withAdvice) Error() string { return w.err.Error() + "; " + w.advice }
func (w withAdvice) Unwrap() error { return w.err }

// askedToWait is the error of a registry that asked to be asked again
// later than vmsnap waits (Retry-After).
func (r *Registry) askedToWait(what string, err error, wait time.Duration) error {
	words := err.Error()
	var terr *transport.Error
	if errors.As(err, &terr) {
		words = registryWords(terr)
	}
	return errcode.New(errcode.RegistryError, "%s: registry %s answered %s and asks to be asked again in %v: try again then",
		what, r.ref.Registry, words, wait.Round(time.Second))
}
