package guest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
)

// fetchDeb downloads a package once, checks it against its pinned SHA256,
// skips (with the reason) when the mirror fails and refuses a package that
// does not match.
func TestFetchDeb(t *testing.T) {
	body := []byte("!<arch>\nnot really a deb\n")
	sum := sha256.Sum256(body)
	good := hex.EncodeToString(sum[:])
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		if r.URL.Path != "/debian/pool/main/x/x/x_1_all.deb" {
			http.NotFound(w, r)
			return
		}
		w.Write(body)
	}))
	defer srv.Close()
	t.Setenv(EnvDebianMirror, srv.URL+"/debian/")
	dir := t.TempDir()
	ctx := context.Background()

	path, skip, err := fetchDeb(ctx, dir, "pool/main/x/x/x_1_all.deb", good)
	if err != nil || skip != "" || filepath.Dir(path) != dir {
		t.Fatalf("fetchDeb: %q, skip %q, %v", path, skip, err)
	}
	if b, _ := os.ReadFile(path); string(b) != string(body) {
		t.Fatalf("stored %q", b)
	}
	// Cached: no second download.
	if _, skip, err := fetchDeb(ctx, dir, "pool/main/x/x/x_1_all.deb", good); err != nil || skip != "" || hits.Load() != 1 {
		t.Fatalf("second fetch: skip %q, %v, %d requests", skip, err, hits.Load())
	}
	// Gone from the mirror: a skip that says so.
	if _, skip, err := fetchDeb(ctx, dir, "pool/main/y/y/y_1_all.deb", good); err != nil || !strings.Contains(skip, "404") {
		t.Fatalf("missing package: skip %q, %v", skip, err)
	}
	// Not what is pinned: an error, and nothing kept.
	if _, _, err := fetchDeb(ctx, t.TempDir(), "pool/main/x/x/x_1_all.deb", strings.Repeat("0", 64)); err == nil || !strings.Contains(err.Error(), "pinned") {
		t.Fatalf("mismatching package: %v", err)
	}
	// No mirror at all: a skip.
	t.Setenv(EnvDebianMirror, "http://127.0.0.1:1/debian/")
	if _, skip, err := fetchDeb(ctx, t.TempDir(), "pool/main/x/x/x_1_all.deb", good); err != nil || !strings.Contains(skip, "failed") {
		t.Fatalf("unreachable mirror: skip %q, %v", skip, err)
	}
}
