package ociimage

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// fakeRegistry is go-containerregistry's in-process registry behind an
// httptest TLS server, with a request log and hooks to break it.
type fakeRegistry struct {
	t      *testing.T
	srv    *httptest.Server
	host   string
	caFile string

	mu  sync.Mutex
	log []string // "METHOD PATH"

	// intercept, if set, may answer a request itself (true) instead of
	// the registry.
	intercept func(w http.ResponseWriter, r *http.Request) bool
	// basic, if set, is the one user:password the server accepts.
	basic string
}

func newFakeRegistry(t *testing.T, opts ...registry.Option) *fakeRegistry {
	t.Helper()
	f := &fakeRegistry{t: t}
	reg := registry.New(append([]registry.Option{registry.Logger(nilLogger())}, opts...)...)
	f.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.log = append(f.log, r.Method+" "+r.URL.Path)
		intercept, basic := f.intercept, f.basic
		f.mu.Unlock()
		if basic != "" {
			user, pass, ok := r.BasicAuth()
			if !ok || user+":"+pass != basic {
				w.Header().Set("WWW-Authenticate", `Basic realm="fake"`)
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusUnauthorized)
				fmt.Fprint(w, `{"errors":[{"code":"UNAUTHORIZED","message":"authentication required","detail":null}]}`)
				return
			}
		}
		if intercept != nil && intercept(w, r) {
			return
		}
		reg.ServeHTTP(w, r)
	}))
	f.srv.Config.ErrorLog = nilLogger() // the TLS tests make it complain
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

func (f *fakeRegistry) requests() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.log...)
}

func (f *fakeRegistry) resetLog() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.log = nil
}

// count returns how many logged requests have method and a path containing
// part.
func (f *fakeRegistry) count(method, part string) int {
	n := 0
	for _, r := range f.requests() {
		m, p, _ := strings.Cut(r, " ")
		if m == method && strings.Contains(p, part) {
			n++
		}
	}
	return n
}

// open opens REPO[:TAG|@DIGEST] on the fake registry, trusting its CA, with
// an empty config directory (anonymous) and fast retries unless opts say
// otherwise.
func (f *fakeRegistry) open(t *testing.T, repo string, opts ...Option) Repository {
	t.Helper()
	ref, err := ParseReference(f.host + "/" + repo)
	if err != nil {
		t.Fatal(err)
	}
	empty := t.TempDir()
	writeFile(t, filepath.Join(empty, "config.json"), `{"auths":{}}`)
	base := []Option{WithCAFile(f.caFile), WithRegistryConfig(empty), WithRetry(4, time.Millisecond)}
	r, err := Open(context.Background(), ref, append(base, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func nilLogger() *log.Logger { return log.New(io.Discard, "", 0) }

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

func writeDockerConfig(t testing.TB, host, user, pass, file string) string {
	t.Helper()
	dir := t.TempDir()
	auth := base64.StdEncoding.EncodeToString([]byte(user + ":" + pass))
	writeFile(t, filepath.Join(dir, file), fmt.Sprintf(`{"auths":{%q:{"auth":%q}}}`, host, auth))
	return dir
}

// testChunks makes n random chunk blobs and their descriptors.
func testChunks(t testing.TB, n, size int) ([]ocispec.Descriptor, [][]byte) {
	t.Helper()
	var descs []ocispec.Descriptor
	var datas [][]byte
	for range n {
		b := make([]byte, size)
		if _, err := rand.Read(b); err != nil {
			t.Fatal(err)
		}
		descs = append(descs, ocispec.Descriptor{
			MediaType: MediaTypeChunk, Digest: digest.FromBytes(b), Size: int64(len(b)),
			Annotations: map[string]string{AnnotationRawSize: fmt.Sprint(size)},
		})
		datas = append(datas, b)
	}
	return descs, datas
}

// putChunks stores chunks the way chunk.EncodeStream does: HasBlob, then
// PutBlob for those missing, several at once.
func putChunks(t testing.TB, repo Repository, descs []ocispec.Descriptor, datas [][]byte) {
	t.Helper()
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, len(descs))
	for i := range descs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			have, err := repo.HasBlob(ctx, descs[i].Digest)
			if err == nil && !have {
				err = repo.PutBlob(ctx, descs[i], datas[i])
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}

type regConfig struct {
	Name string `json:"name"`
}

func pushDisk(t testing.TB, repo Repository, layers []ocispec.Descriptor, subject *ocispec.Descriptor) ocispec.Descriptor {
	t.Helper()
	desc, err := pushTagged(context.Background(), repo, Artifact{
		ArtifactType: ArtifactTypeDisk, ConfigMediaType: MediaTypeDiskConfig,
		Config: regConfig{Name: "disk"}, Layers: layers, Subject: subject,
		Annotations: map[string]string{AnnotationTitle: "overlay.qcow2"},
	})
	if err != nil {
		t.Fatal(err)
	}
	return desc
}

// AddBlob says whether it sent the data: yes for a blob the registry lacks;
// no for one this client has seen stored.
func TestRegistryAddBlobSaysWhetherItSent(t *testing.T) {
	f := newFakeRegistry(t)
	descs, datas := testChunks(t, 1, 64<<10)
	repo := f.open(t, "vm:one").(*Registry)
	for i, want := range []bool{true, false} {
		sent, err := repo.AddBlob(context.Background(), descs[0], datas[0])
		if err != nil || sent != want {
			t.Fatalf("AddBlob #%d: sent %v, %v; want %v", i+1, sent, err, want)
		}
	}
	if n := f.count(http.MethodPut, "/blobs/uploads/"); n != 1 {
		t.Fatalf("%d upload PUTs, want 1", n)
	}
}

// A body that does not match its digest is refused by the registry, and
// that is DIGEST_MISMATCH, not a registry failure to retry.
func TestRegistryPutOfWrongDataIsDigestMismatch(t *testing.T) {
	f := newFakeRegistry(t)
	descs, datas := testChunks(t, 1, 64<<10)
	bad := bytes.Clone(datas[0])
	bad[0] ^= 1
	err := f.open(t, "vm:one").PutBlob(context.Background(), descs[0], bad)
	if errcode.Of(err) != errcode.DigestMismatch {
		t.Fatalf("err = %v, want DIGEST_MISMATCH", err)
	}
	if ok, _ := f.open(t, "vm:one").HasBlob(context.Background(), descs[0].Digest); ok {
		t.Fatal("the registry holds the blob after a put of wrong data")
	}
}

func TestRegistryRoundTrip(t *testing.T) {
	f := newFakeRegistry(t)
	repo := f.open(t, "vms/web:v1")
	descs, datas := testChunks(t, 5, 64<<10)
	putChunks(t, repo, descs, datas)
	pushed := pushDisk(t, repo, descs, nil)

	// A fresh client, as on another node, by tag and by digest.
	for _, r := range []string{"vms/web:v1", "vms/web@" + string(pushed.Digest)} {
		src := f.open(t, r)
		var cfg regConfig
		desc, m, err := PullArtifact(context.Background(), src, ArtifactTypeDisk, &cfg)
		if err != nil {
			t.Fatalf("%s: %v", r, err)
		}
		if desc.Digest != pushed.Digest || desc.Size != pushed.Size || desc.MediaType != ocispec.MediaTypeImageManifest {
			t.Fatalf("%s resolves to %+v, pushed %+v", r, desc, pushed)
		}
		if cfg.Name != "disk" || len(m.Layers) != len(descs) || m.Annotations[AnnotationTitle] != "overlay.qcow2" {
			t.Fatalf("pulled %+v / %+v", cfg, m)
		}
		for i, l := range m.Layers {
			b, err := src.Blob(context.Background(), l, MaxChunkSize)
			if err != nil {
				t.Fatal(err)
			}
			if string(b) != string(datas[i]) {
				t.Fatalf("chunk %d differs after the round trip", i)
			}
		}
	}

	// The manifest went up byte for byte: its digest is what we computed.
	resp := f.get(t, "/v2/vms/web/manifests/v1")
	if got := resp.Header.Get("Docker-Content-Digest"); got != string(pushed.Digest) {
		t.Fatalf("registry has digest %s for the tag, pushed %s", got, pushed.Digest)
	}
}

// get fetches a path from the fake registry directly.
func (f *fakeRegistry) get(t *testing.T, path string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, f.srv.URL+path, nil)
	req.Header.Set("Accept", manifestAccept)
	resp, err := f.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp
}

func TestRegistrySkipsBlobsItHasAndPushesTheManifestLast(t *testing.T) {
	f := newFakeRegistry(t)
	descs, datas := testChunks(t, 6, 32<<10)
	// Two identical chunks (zero pages) go up once.
	descs = append(descs, descs[0])
	datas = append(datas, datas[0])

	putChunks(t, f.open(t, "vm:one"), descs, datas)
	if n := f.count(http.MethodPost, "/blobs/uploads/"); n != 6 {
		t.Fatalf("first push started %d uploads, want 6 (one per distinct chunk)", n)
	}
	// Each upload is one POST and one PUT with the whole body: no PATCH.
	if n, p := f.count(http.MethodPut, "/blobs/uploads/"), f.count(http.MethodPatch, "/blobs/uploads/"); n != 6 || p != 0 {
		t.Fatalf("first push made %d PUTs and %d PATCHes to uploads, want 6 and 0", n, p)
	}

	// A second snapshot with the same chunks, by a new client (another
	// process): it asks, and uploads nothing.
	f.resetLog()
	repo := f.open(t, "vm:two")
	putChunks(t, repo, descs, datas)
	pushDisk(t, repo, descs, nil)
	uploads := f.count(http.MethodPost, "/blobs/uploads/") + f.count(http.MethodPatch, "/blobs/uploads/") + f.count(http.MethodPut, "/blobs/uploads/")
	if uploads != 1*2 { // the config blob only: POST + PUT
		t.Fatalf("second push made %d upload requests, want only the config's: %v", uploads, f.requests())
	}
	if heads := f.count(http.MethodHead, "/blobs/sha256:"); heads < 6 {
		t.Fatalf("second push made %d HEAD requests for blobs, want one per distinct chunk at least", heads)
	}

	// The manifest PUT (which moves the tag) is the last write.
	reqs := f.requests()
	last := -1
	for i, r := range reqs {
		if r == "PUT /v2/vm/manifests/two" {
			last = i
		}
	}
	if last < 0 {
		t.Fatalf("no manifest PUT to the tag: %v", reqs)
	}
	for _, r := range reqs[last+1:] {
		if strings.HasPrefix(r, "PUT ") || strings.HasPrefix(r, "POST ") || strings.HasPrefix(r, "PATCH ") {
			t.Fatalf("a write after the manifest: %s in %v", r, reqs)
		}
	}
}

func TestRegistryRefusesManifestWithMissingBlob(t *testing.T) {
	f := newFakeRegistry(t)
	repo := f.open(t, "vm:x")
	descs, datas := testChunks(t, 2, 1024)
	putChunks(t, repo, descs[:1], datas[:1])
	_, err := pushTagged(context.Background(), repo, Artifact{
		ArtifactType: ArtifactTypeDisk, ConfigMediaType: MediaTypeDiskConfig, Config: regConfig{}, Layers: descs,
	})
	if !errcode.Is(err, errcode.RegistryError) || !strings.Contains(err.Error(), "layer 1 blob") {
		t.Fatalf("got %v, want REGISTRY_ERROR naming layer 1", err)
	}
	if n := f.count(http.MethodPut, "/manifests/"); n != 0 {
		t.Fatalf("a manifest was stored over a missing blob (%d PUTs)", n)
	}
}

func TestRegistryAuth(t *testing.T) {
	f := newFakeRegistry(t)
	f.basic = "alice:s3cret-pw"
	descs, datas := testChunks(t, 1, 1024)

	// Right credentials, from a mounted dockerconfigjson secret.
	good := writeDockerConfig(t, f.host, "alice", "s3cret-pw", ".dockerconfigjson")
	repo := f.open(t, "vm:a", WithRegistryConfig(good))
	if err := CheckAccess(context.Background(), repo); err != nil {
		t.Fatal(err)
	}
	putChunks(t, repo, descs, datas)

	// Wrong password, keyed https://HOST as docker login writes some.
	bad := writeDockerConfig(t, "https://"+f.host, "alice", "wrong-pw-123", "config.json")
	for name, op := range map[string]func(Repository) error{
		"check": func(r Repository) error { return CheckAccess(context.Background(), r) },
		"head":  func(r Repository) error { _, err := r.HasBlob(context.Background(), descs[0].Digest); return err },
		"put":   func(r Repository) error { return r.PutBlob(context.Background(), descs[0], datas[0]) },
		"get":   func(r Repository) error { _, err := r.Blob(context.Background(), descs[0], MaxChunkSize); return err },
	} {
		t.Run(name, func(t *testing.T) {
			f.resetLog()
			err := op(f.open(t, "vm:a", WithRegistryConfig(bad)))
			if !errcode.Is(err, errcode.AuthFailed) {
				t.Fatalf("got %v (%s), want AUTH_FAILED", err, errcode.Of(err))
			}
			msg := err.Error()
			if !strings.Contains(msg, "UNAUTHORIZED: authentication required") || !strings.Contains(msg, filepath.Join(bad, "config.json")) {
				t.Fatalf("message lacks the registry's words or the credentials' file: %s", msg)
			}
			if strings.Contains(msg, "wrong-pw-123") || strings.Contains(msg, base64.StdEncoding.EncodeToString([]byte("alice:wrong-pw-123"))) {
				t.Fatalf("message leaks the password: %s", msg)
			}
			// Refused credentials are not retried.
			if n := len(f.requests()); n > 4 {
				t.Fatalf("%d requests for one refused operation: %v", n, f.requests())
			}
		})
	}

	// No credentials at all: the message says none were found.
	err := CheckAccess(context.Background(), f.open(t, "vm:a"))
	if !errcode.Is(err, errcode.AuthFailed) || !strings.Contains(err.Error(), "no credentials for "+f.host) {
		t.Fatalf("got %v", err)
	}
}

func TestRegistryRetriesTransientFailures(t *testing.T) {
	f := newFakeRegistry(t)
	descs, datas := testChunks(t, 4, 8<<10)
	// Every request fails twice with 500 (or 429, or a reset connection)
	// before the registry answers it; every step of a blob upload (POST,
	// PATCH, PUT) fails twice for the first blobs that get there.
	var seen sync.Map
	var failures atomic.Int64
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		key := r.Method + " " + r.URL.Path
		if strings.Contains(r.URL.Path, "/blobs/uploads/") {
			key = r.Method + " uploads"
		}
		if r.URL.Path == "/v2/" {
			return false
		}
		v, _ := seen.LoadOrStore(key, new(atomic.Int64))
		switch v.(*atomic.Int64).Add(1) {
		case 1:
			failures.Add(1)
			w.WriteHeader(http.StatusInternalServerError)
			fmt.Fprint(w, `{"errors":[{"code":"UNKNOWN","message":"storage hiccup"}]}`)
			return true
		case 2:
			failures.Add(1)
			if r.Method == http.MethodGet {
				// A reset in the middle of a body.
				hj, _ := w.(http.Hijacker)
				conn, _, _ := hj.Hijack()
				conn.Close()
				return true
			}
			w.WriteHeader(http.StatusTooManyRequests)
			return true
		}
		return false
	})
	repo := f.open(t, "vm:retry", WithRetry(8, 5*time.Millisecond))
	putChunks(t, repo, descs, datas)
	pushed := pushDisk(t, repo, descs, nil)
	src := f.open(t, "vm@"+string(pushed.Digest), WithRetry(4, 5*time.Millisecond))
	var cfg regConfig
	_, m, err := PullArtifact(context.Background(), src, ArtifactTypeDisk, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	for i, l := range m.Layers {
		if b, err := src.Blob(context.Background(), l, MaxChunkSize); err != nil || string(b) != string(datas[i]) {
			t.Fatalf("chunk %d after retries: %v", i, err)
		}
	}
	if failures.Load() < 10 {
		t.Fatalf("only %d failures injected; the test did not exercise retries", failures.Load())
	}

	// A registry that keeps failing: REGISTRY_ERROR after the last try,
	// with the registry's words.
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method == http.MethodHead {
			w.WriteHeader(http.StatusServiceUnavailable)
			return true
		}
		return false
	})
	f.resetLog()
	_, err = f.open(t, "vm:retry", WithRetry(3, time.Millisecond)).HasBlob(context.Background(), digest.FromString("x"))
	if !errcode.Is(err, errcode.RegistryError) || !strings.Contains(err.Error(), "503") || !strings.Contains(err.Error(), "gave up after 3 tries") {
		t.Fatalf("got %v", err)
	}
	if n := f.count(http.MethodHead, "/blobs/"); n != 3 {
		t.Fatalf("%d HEAD tries, want 3", n)
	}
}

func TestRegistryRefusesCorruptData(t *testing.T) {
	f := newFakeRegistry(t)
	repo := f.open(t, "vm:lie")
	descs, datas := testChunks(t, 2, 4096)
	putChunks(t, repo, descs, datas)
	pushed := pushDisk(t, repo, descs, nil)
	manifestBody := f.fetchRaw(t, "/v2/vm/manifests/"+string(pushed.Digest))

	lie := func(path string, body []byte) {
		f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
			if r.Method != http.MethodGet || r.URL.Path != path {
				return false
			}
			w.Header().Set("Content-Type", ocispec.MediaTypeImageManifest)
			w.Write(body)
			return true
		})
	}
	ctx := context.Background()

	// A chunk with one byte flipped, and one cut short.
	flipped := append([]byte(nil), datas[1]...)
	flipped[100] ^= 1
	for name, body := range map[string][]byte{"flipped": flipped, "short": datas[1][:4000]} {
		lie("/v2/vm/blobs/"+string(descs[1].Digest), body)
		_, err := f.open(t, "vm:lie").Blob(ctx, descs[1], MaxChunkSize)
		if !errcode.Is(err, errcode.DigestMismatch) {
			t.Fatalf("%s chunk: got %v, want DIGEST_MISMATCH", name, err)
		}
	}
	// A chunk said to be larger than the caller allows is not fetched.
	f.resetLog()
	big := descs[0]
	big.Size = MaxChunkSize + 1
	if _, err := repo.Blob(ctx, big, MaxChunkSize); !errcode.Is(err, errcode.InvalidInput) || len(f.requests()) != 0 {
		t.Fatalf("oversized chunk: %v after %d requests", err, len(f.requests()))
	}

	// A manifest changed in transit, by digest and by tag.
	changed := strings.Replace(string(manifestBody), "overlay.qcow2", "overlay.qcow3", 1)
	lie("/v2/vm/manifests/"+string(pushed.Digest), []byte(changed))
	if _, err := f.open(t, "vm:lie").Manifest(ctx, pushed); !errcode.Is(err, errcode.DigestMismatch) {
		t.Fatalf("changed manifest: got %v, want DIGEST_MISMATCH", err)
	}
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if !strings.HasSuffix(r.URL.Path, "/manifests/lie") {
			return false
		}
		w.Header().Set("Content-Type", ocispec.MediaTypeImageManifest)
		w.Header().Set("Docker-Content-Digest", string(pushed.Digest))
		if r.Method == http.MethodHead {
			w.WriteHeader(http.StatusMethodNotAllowed) // force the GET
			return true
		}
		w.Write([]byte(changed))
		return true
	})
	if _, err := f.open(t, "vm:lie").Resolve(ctx); !errcode.Is(err, errcode.DigestMismatch) {
		t.Fatalf("tag whose manifest does not match its digest header: got %v", err)
	}
}

func (f *fakeRegistry) fetchRaw(t *testing.T, path string) []byte {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, f.srv.URL+path, nil)
	req.Header.Set("Accept", manifestAccept)
	resp, err := f.srv.Client().Do(req)
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

func TestRegistryReferrers(t *testing.T) {
	for _, api := range []bool{false, true} {
		t.Run(fmt.Sprintf("referrersAPI=%v", api), func(t *testing.T) {
			f := newFakeRegistry(t, registry.WithReferrersSupport(api))
			ctx := context.Background()
			descs, datas := testChunks(t, 2, 1024)
			disk := f.open(t, "vm:snap-disk")
			putChunks(t, disk, descs, datas)
			diskDesc := pushDisk(t, disk, descs[:1], nil)

			state := f.open(t, "vm:snap")
			subject := diskDesc
			stateDesc, err := pushTagged(ctx, state, Artifact{
				ArtifactType: ArtifactTypeVMState, ConfigMediaType: MediaTypeVMStateConfig, Config: regConfig{Name: "state"},
				Layers: descs[1:], Subject: &subject, Annotations: map[string]string{AnnotationMode: "pause"},
			})
			if err != nil {
				t.Fatal(err)
			}
			got, err := f.open(t, "vm@"+string(diskDesc.Digest)).Referrers(ctx, diskDesc)
			if err != nil {
				t.Fatal(err)
			}
			// (go-containerregistry's in-process registry reports the config
			// media type as the artifact type; the spec and the fallback
			// index use the manifest's artifactType.)
			if len(got) != 1 || got[0].Digest != stateDesc.Digest || got[0].Annotations[AnnotationMode] != "pause" ||
				(got[0].ArtifactType != ArtifactTypeVMState && !(api && got[0].ArtifactType == MediaTypeVMStateConfig)) {
				t.Fatalf("referrers of the disk: %+v, want the state manifest %s", got, stateDesc.Digest)
			}
			fallback := strings.Replace(string(diskDesc.Digest), ":", "-", 1)
			hasFallback := f.get(t, "/v2/vm/manifests/"+fallback).StatusCode == http.StatusOK
			if hasFallback == api {
				t.Fatalf("fallback tag %s present=%v with referrers API=%v", fallback, hasFallback, api)
			}
			// The state image has no referrers.
			if got, err := state.Referrers(ctx, stateDesc); err != nil || len(got) != 0 {
				t.Fatalf("referrers of the state image: %v, %v", got, err)
			}
		})
	}
}

func TestRegistryTLSAndPlainHTTP(t *testing.T) {
	ctx := context.Background()
	f := newFakeRegistry(t)
	ref, _ := ParseReference(f.host + "/vm:x")
	empty := t.TempDir()

	// Without the CA: a clear TLS error that points at --ca-file, and no
	// fall back to plain HTTP although the host is 127.0.0.1.
	repo, err := Open(ctx, ref, WithRegistryConfig(writeDockerConfig(t, f.host, "u", "p", "config.json")), WithRetry(2, time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	err = CheckAccess(ctx, repo)
	if !errcode.Is(err, errcode.RegistryError) || !strings.Contains(err.Error(), "caFile") || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("got %v, want REGISTRY_ERROR about the certificate and --ca-file", err)
	}

	// A plain HTTP registry on 127.0.0.1: refused unless named insecure.
	plain := httptest.NewServer(registry.New(registry.Logger(nilLogger())))
	defer plain.Close()
	host := strings.TrimPrefix(plain.URL, "http://")
	pref, _ := ParseReference(host + "/vm:x")
	writeFile(t, filepath.Join(empty, "config.json"), "{}")
	repo, _ = Open(ctx, pref, WithRegistryConfig(empty), WithRetry(1, 0))
	err = CheckAccess(ctx, repo)
	if !errcode.Is(err, errcode.RegistryError) || !strings.Contains(err.Error(), "`insecureRegistry` "+host) {
		t.Fatalf("got %v, want REGISTRY_ERROR suggesting --insecure-registry", err)
	}
	repo, _ = Open(ctx, pref, WithRegistryConfig(empty), WithInsecureRegistry(host))
	descs, datas := testChunks(t, 1, 512)
	putChunks(t, repo, descs, datas)
	pushDisk(t, repo, descs, nil)
	if _, err := repo.Resolve(ctx); err != nil {
		t.Fatal(err)
	}

	// Options that cannot work fail in Open.
	if _, err := Open(ctx, ref, WithCAFile(filepath.Join(empty, "config.json"))); !errcode.Is(err, errcode.Usage) {
		t.Fatalf("a CA file without certificates: %v", err)
	}
	if _, err := Open(ctx, ref, WithRegistryConfig(t.TempDir())); !errcode.Is(err, errcode.InvalidInput) {
		t.Fatalf("a config directory without config.json: %v", err)
	}
}

func TestRegistryHonoursCancellation(t *testing.T) {
	f := newFakeRegistry(t)
	repo := f.open(t, "vm:x")
	descs, datas := testChunks(t, 1, 1024)
	putChunks(t, repo, descs, datas)
	release := make(chan struct{})
	defer close(release)
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/blobs/") {
			select { // a registry that hangs
			case <-release:
			case <-r.Context().Done():
			}
			return true
		}
		return false
	})
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	// The registry answers only when the test ends: only the deadline can
	// end Blob.
	_, err := repo.Blob(ctx, descs[0], MaxChunkSize)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want the context's deadline", err)
	}
}

func TestLayoutReferrers(t *testing.T) {
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "store")
	open := func(s string) Repository {
		ref, err := ParseReference("oci:" + dir + s)
		if err != nil {
			t.Fatal(err)
		}
		r, err := Open(ctx, ref)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	disk := open(":d")
	descs, datas := testChunks(t, 1, 100)
	putChunks(t, disk, descs, datas)
	diskDesc := pushDisk(t, disk, descs, nil)
	var states []digest.Digest
	for _, tag := range []string{":s1", ":s2"} {
		s := diskDesc
		d, err := pushTagged(ctx, open(tag), Artifact{
			ArtifactType: ArtifactTypeVMState, ConfigMediaType: MediaTypeVMStateConfig, Config: regConfig{Name: tag},
			Layers: descs, Subject: &s,
		})
		if err != nil {
			t.Fatal(err)
		}
		states = append(states, d.Digest)
	}
	got, err := open("").Referrers(ctx, diskDesc)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Digest != states[0] || got[1].Digest != states[1] || got[0].ArtifactType != ArtifactTypeVMState {
		t.Fatalf("layout referrers: %+v, want %v", got, states)
	}
}

func TestCredentialsFile(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "config.json"), `{"auths":{"other.example:5000":{"auth":"eDp5"}},"credsStore":"desktop"}`)
	c, err := loadCredentials(dir, "reg.example:5000")
	if err != nil || c.found || !strings.Contains(c.where, "docker-credential-desktop") {
		t.Fatalf("%+v %v", c, err)
	}
	writeFile(t, filepath.Join(dir, "config.json"), `{"auths":{"reg.example:5000":{"auth":"not base64!"}}}`)
	if _, err := loadCredentials(dir, "reg.example:5000"); !errcode.Is(err, errcode.InvalidInput) {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "config.json"), `{"auths":{"reg.example:5000":{"auth":"c2VjcmV0`)
	if _, err := loadCredentials(dir, "reg.example:5000"); !errcode.Is(err, errcode.InvalidInput) || strings.Contains(err.Error(), "c2Vj") {
		t.Fatalf("broken JSON: %v", err)
	}
	// DOCKER_CONFIG is the default directory; a missing one is anonymous.
	t.Setenv("DOCKER_CONFIG", writeDockerConfig(t, "reg.example:5000", "u", "p", "config.json"))
	if c, err := loadCredentials("", "reg.example:5000"); err != nil || !c.found {
		t.Fatalf("%+v %v", c, err)
	}
	t.Setenv("DOCKER_CONFIG", filepath.Join(dir, "missing"))
	if c, err := loadCredentials("", "reg.example:5000"); err != nil || c.found {
		t.Fatalf("%+v %v", c, err)
	}
}

// A registry that accepts an upload and then never answers: each try runs
// out of its own time and the push fails as REGISTRY_ERROR naming the
// registry, without waiting for the caller's (long) deadline.
func TestRegistryStallFailsEachTryOnItsOwn(t *testing.T) {
	f := newFakeRegistry(t)
	repo := f.open(t, "vm:x", WithRetry(2, 10*time.Millisecond))
	repo.(*Registry).tryBase = 300 * time.Millisecond
	descs, datas := testChunks(t, 1, 4096)
	release := make(chan struct{})
	defer close(release)
	var stalls atomic.Int64
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if strings.Contains(r.URL.Path, "/blobs/uploads/") {
			stalls.Add(1)
			select { // reads nothing more, answers nothing
			case <-release:
			case <-r.Context().Done():
			}
			return true
		}
		return false
	})
	start := time.Now()
	err := repo.PutBlob(context.Background(), descs[0], datas[0])
	took := time.Since(start)
	if errcode.Of(err) != errcode.RegistryError || !strings.Contains(err.Error(), "stopped answering") || !strings.Contains(err.Error(), f.host) {
		t.Fatalf("err = %v, want REGISTRY_ERROR saying the registry %s stopped answering", err, f.host)
	}
	// The registry answers only when the test ends: only the per-try
	// deadline can end each try.
	if stalls.Load() != 2 {
		t.Fatalf("%d stalled tries in %v, want 2", stalls.Load(), took)
	}
}
