package ociimage

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

func TestParseRetryAfter(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for v, want := range map[string]time.Duration{
		"0": 0, "7": 7 * time.Second, "3600": time.Hour,
		now.Add(90 * time.Second).Format(http.TimeFormat): 90 * time.Second,
		now.Add(-time.Hour).Format(http.TimeFormat):       0, // in the past: no wait
	} {
		if got, ok := parseRetryAfter(v, now); !ok || got != want {
			t.Errorf("Retry-After %q: %v, %v; want %v", v, got, ok, want)
		}
	}
	for _, v := range []string{"", "soon", "-1", "1.5", "99999999999"} {
		if got, ok := parseRetryAfter(v, now); ok {
			t.Errorf("Retry-After %q read as %v", v, got)
		}
	}
}

// busyRegistry answers a blob's HEAD with status and Retry-After
// retryAfter the first times times, then lets the registry answer.
func busyRegistry(t *testing.T, status int, retryAfter string, times int64) (*fakeRegistry, *atomic.Int64) {
	f := newFakeRegistry(t)
	var heads atomic.Int64
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method != http.MethodHead || !strings.Contains(r.URL.Path, "/blobs/") || heads.Add(1) > times {
			return false
		}
		w.Header().Set("Retry-After", retryAfter)
		w.WriteHeader(status)
		return true
	})
	return f, &heads
}

// A registry that asks to wait a second is asked again no sooner.
func TestRegistryHonoursRetryAfter(t *testing.T) {
	f, heads := busyRegistry(t, http.StatusServiceUnavailable, "1", 2)
	start := time.Now()
	have, err := f.open(t, "vm:x", WithRetry(4, time.Millisecond)).HasBlob(context.Background(), digest.FromString("x"))
	if err != nil || have {
		t.Fatalf("HasBlob after two 503s: %v, %v", have, err)
	}
	if heads.Load() != 3 {
		t.Fatalf("%d HEADs, want 3", heads.Load())
	}
	// A lower bound, which no load can break: two waits of at least 1 s.
	if took := time.Since(start); took < 2*time.Second {
		t.Fatalf("the tries were %v apart in all, want at least the 2 s the registry asked for", took)
	}
}

// A registry that asks to wait longer than vmsnap waits, or than the
// caller's deadline allows, is given up on at once, saying when to try
// again.
func TestRegistryGivesUpOnALongRetryAfter(t *testing.T) {
	for name, c := range map[string]struct {
		retryAfter string
		deadline   time.Duration
		says       string
	}{
		"an hour":                    {"3600", time.Minute, "asks to be asked again in 1h0m0s: try again then"},
		"past the caller's patience": {"20", 5 * time.Second, "asks to be asked again in 20s: try again then"},
	} {
		t.Run(name, func(t *testing.T) {
			f, heads := busyRegistry(t, http.StatusTooManyRequests, c.retryAfter, 100)
			ctx, cancel := context.WithTimeout(context.Background(), c.deadline)
			defer cancel()
			_, err := f.open(t, "vm:x", WithRetry(4, time.Millisecond)).HasBlob(ctx, digest.FromString("x"))
			if errcode.Of(err) != errcode.RegistryError || !strings.Contains(err.Error(), "429 Too Many Requests") || !strings.Contains(err.Error(), c.says) {
				t.Fatalf("got %v", err)
			}
			if heads.Load() != 1 {
				t.Fatalf("%d HEADs, want 1: no retry when the registry asks to wait that long", heads.Load())
			}
		})
	}
}
