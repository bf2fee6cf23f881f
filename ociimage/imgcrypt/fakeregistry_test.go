package imgcrypt

import (
	"encoding/pem"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"

	"github.com/vmsnap/vmsnap/ociimage"
)

// fakeRegistry is go-containerregistry's in-process registry behind an
// httptest TLS server, with a hook to break it: what the decryption tests
// need of package ociimage's fake registry of the same name.
type fakeRegistry struct {
	srv    *httptest.Server
	host   string
	caFile string

	mu sync.Mutex
	// intercept, if set, may answer a request itself (true) instead of
	// the registry.
	intercept func(w http.ResponseWriter, r *http.Request) bool
}

func newFakeRegistry(t *testing.T) *fakeRegistry {
	t.Helper()
	f := &fakeRegistry{}
	quiet := log.New(io.Discard, "", 0)
	reg := registry.New(registry.Logger(quiet))
	f.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		intercept := f.intercept
		f.mu.Unlock()
		if intercept != nil && intercept(w, r) {
			return
		}
		reg.ServeHTTP(w, r)
	}))
	f.srv.Config.ErrorLog = quiet
	f.srv.StartTLS()
	t.Cleanup(f.srv.Close)
	f.host = strings.TrimPrefix(f.srv.URL, "https://")
	f.caFile = filepath.Join(t.TempDir(), "ca.pem")
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: f.srv.Certificate().Raw})
	if err := os.WriteFile(f.caFile, pemBytes, 0o644); err != nil {
		t.Fatal(err)
	}
	return f
}

func (f *fakeRegistry) setIntercept(h func(w http.ResponseWriter, r *http.Request) bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.intercept = h
}

// open opens REPO[:TAG|@DIGEST] on the fake registry, trusting its CA,
// anonymously, with fast retries.
func (f *fakeRegistry) open(t *testing.T, repo string, opts ...ociimage.Option) ociimage.Repository {
	t.Helper()
	empty := t.TempDir()
	if err := os.WriteFile(filepath.Join(empty, "config.json"), []byte(`{"auths":{}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	base := []ociimage.Option{ociimage.WithCAFile(f.caFile), ociimage.WithRegistryConfig(empty), ociimage.WithRetry(4, time.Millisecond)}
	return openRef(t, f.host+"/"+repo, append(base, opts...)...)
}

// fetchRaw reads a blob as the registry serves it.
func (f *fakeRegistry) fetchRaw(t *testing.T, path string) []byte {
	t.Helper()
	resp, err := f.srv.Client().Get(f.srv.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
