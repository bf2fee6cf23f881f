package ociimage

import (
	"context"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// A registry that answers 429 Too Many Requests or a 5xx may say when to
// ask again (Retry-After: seconds, or an HTTP date). withRetry waits at
// least that long before its next try, if that is at most maxRetryAfter and
// within the caller's deadline; otherwise it gives up at once, saying when
// the registry wants to be asked again, rather than sleep past the caller's
// patience.
const maxRetryAfter = 30 * time.Second

type retryHintKey struct{}

// retryHint is the last Retry-After the responses of one try carried.
type retryHint struct {
	mu    sync.Mutex
	after time.Duration
	set   bool
}

// withRetryHint gives a try's requests a place to leave a Retry-After.
func withRetryHint(ctx context.Context) (context.Context, *retryHint) {
	h := &retryHint{}
	return context.WithValue(ctx, retryHintKey{}, h), h
}

func (h *retryHint) get() (time.Duration, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.after, h.set
}

// noteRetryAfter keeps a response's Retry-After, if it is one that asks to
// wait, where the try that made the request looks for it. Every request
// passes here (plainHTTPGuard), whoever made it: our reads, and
// go-containerregistry's pushes and auth.
func noteRetryAfter(resp *http.Response) {
	if resp == nil || resp.Request == nil || resp.StatusCode != http.StatusTooManyRequests && resp.StatusCode < 500 {
		return
	}
	h, ok := resp.Request.Context().Value(retryHintKey{}).(*retryHint)
	if !ok {
		return
	}
	after, ok := parseRetryAfter(resp.Header.Get("Retry-After"), time.Now())
	if !ok {
		return
	}
	h.mu.Lock()
	h.after, h.set = after, true
	h.mu.Unlock()
}

// parseRetryAfter reads a Retry-After value: delay-seconds or an HTTP date
// (RFC 9110 10.2.3). A date in the past is no wait.
func parseRetryAfter(v string, now time.Time) (time.Duration, bool) {
	if v == "" {
		return 0, false
	}
	if s, err := strconv.ParseUint(v, 10, 32); err == nil {
		return time.Duration(s) * time.Second, true
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	return max(t.Sub(now), 0), true
}

// waitFits reports whether waiting d before the next try is reasonable:
// at most maxRetryAfter, and ending before ctx's deadline.
func waitFits(ctx context.Context, d time.Duration) bool {
	if d > maxRetryAfter {
		return false
	}
	deadline, ok := ctx.Deadline()
	return !ok || time.Until(deadline) > d
}
