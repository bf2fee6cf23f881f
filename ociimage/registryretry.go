package ociimage

// The registry client's retries: which failures are tried again, how long
// one try may take, and the pauses between tries.

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

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
