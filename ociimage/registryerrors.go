package ociimage

// The registry client's errors: a failed request as a coded error whose
// message says what failed and what to do (TLS, plain HTTP, credentials,
// the registry's own words).

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

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
