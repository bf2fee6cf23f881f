//go:build linux

package e2e

// The fault matrix, each fault injected into the real part where it lives:
// a real registry (docker-registry with TLS and htpasswd, internal/testing/registry)
// behind a small TLS reverse proxy of our own that answers 500s, stalls or
// throttles; a real QEMU (TCG guests, internal/testing/guest) killed with SIGKILL
// mid-stream, or started on a CPU with other features; a real filesystem that
// fills up (a tiny tmpfs). For each fault the test asserts the error code and
// exit status, the VM's state afterwards (seen through a second QMP monitor
// of the test's own), that no tag names a partial snapshot, and that no
// temporary file is left behind.
//
// Covered elsewhere: the agent killed mid-checkpoint
// (TestAgentE2EKilledAgentContinuesVMOnRestart) and the registry killed
// mid-push (TestRegistryE2EKilledMidPush).

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
)

// --- a guest with a monitor for the test's own eyes ---

type faultVM struct {
	vm      *guest.VM
	monitor string // a second QMP socket: vmsnap holds the first
}

// startFaultVM starts a guest with a second QMP monitor and, unless it waits
// for an incoming migration, waits for its first status line.
func startFaultVM(t *testing.T, opts guest.Options) *faultVM {
	t.Helper()
	guest.Assets(t)
	if opts.Dir == "" {
		opts.Dir = guest.FreeShortDir(t)
	}
	mon := filepath.Join(opts.Dir, "test-mon.sock")
	opts.ExtraArgs = append(opts.ExtraArgs, "-qmp", "unix:"+mon+",server=on,wait=off")
	f := &faultVM{monitor: mon}
	if opts.Incoming {
		f.vm = guest.Start(t, opts)
	} else {
		f.vm, _ = bootGuest(t, opts)
	}
	return f
}

func (f *faultVM) qmp(command string, v any) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	raw, err := guest.QMP(ctx, f.monitor, command, nil)
	if err != nil {
		return err
	}
	return json.Unmarshal(raw, v)
}

func (f *faultVM) status(t *testing.T) string {
	t.Helper()
	var st struct{ Status string }
	if err := f.qmp("query-status", &st); err != nil {
		t.Fatalf("query-status on the test's monitor: %v", err)
	}
	return st.Status
}

// assertRunning checks that QEMU says the VM runs and that the guest counts on.
func (f *faultVM) assertRunning(t *testing.T, after string) {
	t.Helper()
	if st := f.status(t); st != "running" {
		t.Fatalf("the VM is %s %s, want running", st, after)
	}
	last, _ := f.vm.LastStatus()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := f.vm.WaitStatus(ctx, func(s guest.Status) bool { return s.Counter > last.Counter }); err != nil {
		t.Fatalf("the guest does not count on %s: %v", after, err)
	}
}

// assertGone waits for a killed QEMU's exit.
func (f *faultVM) assertGone(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = f.vm.Wait(ctx)
	if !f.vm.Exited() {
		t.Fatal("the killed QEMU is still there")
	}
}

// --- a TLS reverse proxy in front of the real registry ---

// faultProxy forwards everything to the test registry over TLS, on its own
// address (so image references name it), and injects faults into blob
// uploads and downloads: an upload's data request (a PATCH to
// .../blobs/uploads/..., or a PUT there with the whole body) and a blob's
// GET are where a registry's disk or network trouble shows.
type faultProxy struct {
	Host      string // 127.0.0.1:PORT, the registry part of references through the proxy
	CAFile    string // the proxy's certificate, for --ca-file
	ConfigDir string // credentials for Host, for --registry-config

	srv  *httptest.Server
	quit chan struct{}

	// failUploads is how many more upload data requests are answered 500
	// (their bodies read first, as a registry that failed to store them
	// would).
	failUploads atomic.Int32
	injected    atomic.Int32
	// stallAfter, when above 0: the upload data requests after that many
	// forwarded ones are accepted (64 KiB of their body read) and then
	// never answered.
	stallAfter atomic.Int32
	// stallReadsAfter, when above 0: the blob GETs after that many
	// forwarded ones are accepted and never answered.
	stallReadsAfter atomic.Int32
	// stallDeletesAfter, when above 0: the manifest DELETEs after that
	// many forwarded ones are accepted and never answered.
	stallDeletesAfter atomic.Int32
	deletes           atomic.Int32 // manifest DELETEs forwarded
	stalls            atomic.Int32
	stalled           chan struct{} // closed at the first stall
	stallOnce         sync.Once

	uploadStarts atomic.Int32 // POST .../blobs/uploads/ (each try of an upload starts one)
	patches      atomic.Int32 // upload data requests forwarded
	blobReads    atomic.Int32 // blob GETs forwarded
	commits      atomic.Int32 // PUT ...?digest= answered 201: blobs stored
	bytesUp      atomic.Int64 // request bodies forwarded
	bytesDown    atomic.Int64 // response bodies forwarded

	limit *faultLimiter // nil: no throttle
}

func startFaultProxy(t *testing.T, reg *registry.Registry) *faultProxy {
	t.Helper()
	target, _ := url.Parse("https://" + reg.Host)
	p := &faultProxy{quit: make(chan struct{}), stalled: make(chan struct{})}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			// The registry builds upload locations from Host: keep them
			// pointing at the proxy.
			pr.Out.Host = pr.In.Host
			if pr.Out.Body != nil {
				pr.Out.Body = &faultBody{r: pr.Out.Body, n: &p.bytesUp, limit: p.limit}
			}
		},
		ModifyResponse: func(resp *http.Response) error {
			if resp.Request.Method == http.MethodPut && strings.Contains(resp.Request.URL.Path, "/blobs/uploads/") && resp.StatusCode == http.StatusCreated {
				p.commits.Add(1)
			}
			resp.Body = &faultBody{r: resp.Body, n: &p.bytesDown, limit: p.limit}
			return nil
		},
		Transport:     reg.Transport(),
		FlushInterval: -1,
		ErrorLog:      log.New(io.Discard, "", 0),
	}
	// stall accepts a request and then never answers it: no more reads,
	// no response, until the client gives up or the test ends.
	stall := func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.CopyN(io.Discard, r.Body, 64<<10)
		p.stalls.Add(1)
		p.stallOnce.Do(func() { close(p.stalled) })
		select {
		case <-r.Context().Done():
		case <-p.quit:
		}
		panic(http.ErrAbortHandler) // drop the connection without a response
	}
	p.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		upload := strings.Contains(r.URL.Path, "/blobs/uploads/")
		// An upload's data goes in PATCHes (then an empty PUT commits
		// it), or all in the committing PUT.
		data := upload && (r.Method == http.MethodPatch || r.Method == http.MethodPut && r.ContentLength != 0)
		blobRead := r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/blobs/sha256:")
		switch {
		case upload && r.Method == http.MethodPost:
			p.uploadStarts.Add(1)
		case data:
			if p.failUploads.Add(-1) >= 0 {
				_, _ = io.Copy(io.Discard, r.Body)
				p.injected.Add(1)
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusInternalServerError)
				_, _ = io.WriteString(w, `{"errors":[{"code":"UNKNOWN","message":"injected fault: storage driver error"}]}`)
				return
			}
			if n := p.stallAfter.Load(); n > 0 && p.patches.Load() >= n {
				stall(w, r)
			}
			p.patches.Add(1)
		case blobRead:
			if n := p.stallReadsAfter.Load(); n > 0 && p.blobReads.Load() >= n {
				stall(w, r)
			}
			p.blobReads.Add(1)
		case r.Method == http.MethodDelete:
			if n := p.stallDeletesAfter.Load(); n > 0 && p.deletes.Load() >= n {
				stall(w, r)
			}
			p.deletes.Add(1)
		}
		rp.ServeHTTP(w, r)
	}))
	p.srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	p.srv.StartTLS()
	t.Cleanup(func() {
		close(p.quit)
		p.srv.CloseClientConnections()
		p.srv.Close()
	})
	p.Host = strings.TrimPrefix(p.srv.URL, "https://")
	p.CAFile, p.ConfigDir = proxyAccess(t, p.srv, reg, p.Host)
	return p
}

// proxyAccess writes what a client needs to reach reg through srv, a TLS
// server of the test's own at host: srv's certificate (for --ca-file) and
// reg's credentials for host (for --registry-config).
func proxyAccess(t *testing.T, srv *httptest.Server, reg *registry.Registry, host string) (caFile, configDir string) {
	return certificateFile(t, srv), dockerConfig(t, reg, host)
}

// certificateFile writes srv's certificate (PEM) and returns its path.
func certificateFile(t *testing.T, srv *httptest.Server) string {
	t.Helper()
	f := filepath.Join(t.TempDir(), "proxy-ca.pem")
	if err := os.WriteFile(f, pemEncode(srv.Certificate().Raw), 0o600); err != nil {
		t.Fatal(err)
	}
	return f
}

// dockerConfig writes a Docker config directory with reg's credentials for
// each of hosts and returns it.
func dockerConfig(t *testing.T, reg *registry.Registry, hosts ...string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "docker")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	auth := base64.StdEncoding.EncodeToString([]byte(reg.User + ":" + reg.Password))
	auths := map[string]any{}
	for _, h := range hosts {
		auths[h] = map[string]string{"auth": auth}
	}
	b, _ := json.Marshal(map[string]any{"auths": auths})
	if err := os.WriteFile(filepath.Join(dir, "config.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	return dir
}

func pemEncode(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

// args are the flags that reach the registry through the proxy.
func (p *faultProxy) args() []string {
	return []string{"--registry-config", p.ConfigDir, "--ca-file", p.CAFile}
}

// faultLimiter paces bytes to a rate shared by every connection.
type faultLimiter struct {
	mu   sync.Mutex
	rate float64 // bytes per second
	next time.Time
}

func (l *faultLimiter) wait(n int) {
	l.mu.Lock()
	now := time.Now()
	if l.next.Before(now) {
		l.next = now
	}
	at := l.next
	l.next = l.next.Add(time.Duration(float64(n) / l.rate * float64(time.Second)))
	l.mu.Unlock()
	time.Sleep(time.Until(at))
}

// faultBody counts (and with a limiter, paces) a body.
type faultBody struct {
	r     io.ReadCloser
	n     *atomic.Int64
	limit *faultLimiter
}

func (b *faultBody) Read(p []byte) (int, error) {
	if b.limit != nil && len(p) > 16<<10 {
		p = p[:16<<10]
	}
	n, err := b.r.Read(p)
	if n > 0 {
		if b.limit != nil {
			b.limit.wait(n)
		}
		b.n.Add(int64(n))
	}
	return n, err
}

func (b *faultBody) Close() error { return b.r.Close() }

// --- what must not be left behind ---

// tempFiles lists the temporary files vmsnap writes (a layout's
// .DIGEST.*.tmp blobs, an overlay's .NAME.vmsnap-tmp-*) under dir.
func tempFiles(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && (strings.HasSuffix(d.Name(), ".tmp") || strings.Contains(d.Name(), ".vmsnap-tmp-")) {
			out = append(out, p)
		}
		return nil
	})
	return out
}

// layoutIndex reads an OCI layout's index.json; a missing one is empty.
func layoutIndex(t *testing.T, dir string) ocispec.Index {
	t.Helper()
	var idx ocispec.Index
	b, err := os.ReadFile(filepath.Join(dir, "index.json"))
	if os.IsNotExist(err) {
		return idx
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &idx); err != nil {
		t.Fatalf("index.json of %s: %v", dir, err)
	}
	return idx
}

// layoutManifests lists the manifests a layout's index.json names, each as
// "DIGEST TAG" (none if there is no index).
func layoutManifests(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	for _, m := range layoutIndex(t, dir).Manifests {
		out = append(out, m.Digest.String()+" "+m.Annotations[ocispec.AnnotationRefName])
	}
	return out
}

func countFiles(dir string) (n int, bytes int64) {
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			if fi, err := d.Info(); err == nil {
				n++
				bytes += fi.Size()
			}
		}
		return nil
	})
	return n, bytes
}

// cliFail runs vmsnap with --json, expects a failure, and returns its error
// object, after checking that the exit status is the code's.
func cliFail(t *testing.T, args ...string) api.ErrorDoc {
	t.Helper()
	out, exit := cli(t, append(args, "--json")...)
	var doc api.ErrorDoc
	if err := json.Unmarshal(out, &doc); err != nil || doc.Error.Code == "" {
		t.Fatalf("exit %d with no JSON error object on stdout: %v\n%s", exit, err, out)
	}
	if exit != doc.Error.Code.ExitStatus() {
		t.Fatalf("exit %d for %s, want %d", exit, doc.Error.Code, doc.Error.Code.ExitStatus())
	}
	return doc
}

// --- 1. the registry answers 500s, then recovers ---

func TestFaultRegistry500sThenRecovers(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	reg := registry.Start(t)
	px := startFaultProxy(t, reg)
	const failures = 3
	px.failUploads.Store(failures)
	src := startFaultVM(t, guest.Options{})

	start := time.Now()
	cp := cliJSON[api.CheckpointResult](t, with([]string{"checkpoint", "--qmp", src.vm.QMPPath(),
		"--image", px.Host + "/vms/flaky:snap", "--mode", "snapshot", "--chunk-size", "1048576"}, px.args()...)...)
	took := time.Since(start)

	if n := px.injected.Load(); n != failures {
		t.Fatalf("%d uploads were answered 500, want %d", n, failures)
	}
	// Every try of an upload starts a new upload session: each failed one
	// was tried again, and every blob was stored once.
	starts, commits := px.uploadStarts.Load(), px.commits.Load()
	if starts != commits+failures {
		t.Fatalf("%d upload sessions for %d stored blobs and %d failures: want one retry per failure", starts, commits, failures)
	}
	t.Logf("registry 500s: %d failed uploads retried (%d upload sessions for %d stored blobs, %d chunks), checkpoint took %v",
		failures, starts, commits, cp.VMState.Chunks, took.Round(time.Millisecond))
	if !cp.VMRunning {
		t.Fatal("the result says the VM is stopped after a snapshot-mode checkpoint")
	}
	src.assertRunning(t, "after a checkpoint whose uploads were retried")
	if tags := reg.Tags(t, "vms/flaky"); !slices.Contains(tags, "snap") {
		t.Fatalf("no tag snap after the checkpoint succeeded: %v", tags)
	}
	direct := strings.Replace(cp.VMState.Image, px.Host, reg.Host, 1)
	if m := manifestFromRegistry(t, reg, direct); len(m.Layers) != cp.VMState.Chunks {
		t.Fatalf("the stored manifest names %d chunks, the checkpoint made %d", len(m.Layers), cp.VMState.Chunks)
	}
}

// --- 2. the registry accepts an upload and then stalls ---

// runStalledCheckpoint checkpoints through a proxy that stalls the third and
// later blob uploads, and returns the error and how long the checkpoint took.
func runStalledCheckpoint(t *testing.T, extra ...string) (*faultVM, *registry.Registry, *faultProxy, api.ErrorDoc, time.Duration) {
	t.Helper()
	guest.Assets(t)
	reg := registry.Start(t)
	px := startFaultProxy(t, reg)
	px.stallAfter.Store(2)
	src := startFaultVM(t, guest.Options{})
	start := time.Now()
	doc := cliFail(t, with(with([]string{"checkpoint", "--qmp", src.vm.QMPPath(),
		"--image", px.Host + "/vms/stalled:snap", "--mode", "snapshot", "--chunk-size", "262144"}, px.args()...), extra...)...)
	took := time.Since(start)
	select {
	case <-px.stalled:
	default:
		t.Fatalf("the checkpoint failed before the proxy stalled an upload: %s: %s", doc.Error.Code, doc.Error.Message)
	}
	return src, reg, px, doc, took
}

// stallGuard bounds how long a command stuck on a stalled registry may
// take to give up: far above what the deadlines under test need on a loaded
// machine, far below the caller's 30-minute default that a missing
// deadline would leave.
const stallGuard = 8 * time.Minute

// With --timeout shorter than a registry request's own deadline, the
// caller's deadline ends a checkpoint stuck on a stalled registry, and then a
// restore stuck on one. Each still fails as REGISTRY_ERROR, what it was
// waiting for, and says that its --timeout ran out: the VM runs again, no
// tag is written and no staged file is left.
func TestFaultRegistryStallEndsAtTheCallersTimeout(t *testing.T) {
	t.Parallel()
	// A registry request's own deadline is 20 s and more.
	const timeout = 10 * time.Second
	src, reg, px, doc, took := runStalledCheckpoint(t, "--timeout", timeout.String())
	t.Logf("stalled registry: %d uploads stalled after %d went through; checkpoint failed after %v with %s: %s",
		px.stalls.Load(), px.patches.Load(), took.Round(time.Millisecond), doc.Error.Code, doc.Error.Message)
	if took < timeout-time.Second {
		t.Fatalf("the checkpoint ended after %v, before its %v timeout: something else gave up first (%s)", took, timeout, doc.Error.Message)
	}
	// What ended it is checked by its message (assertTimedOut); this only
	// guards against a command that hangs on after its deadline.
	if took > timeout+stallGuard {
		t.Fatalf("the checkpoint took %v to give up with a %v timeout", took, timeout)
	}
	assertTimedOut(t, doc, timeout)
	if !strings.Contains(doc.Error.Message, "the VM was continued") {
		t.Errorf("the error does not say the VM was continued: %s", doc.Error.Message)
	}
	src.assertRunning(t, "after a checkpoint stuck on a stalled registry")
	if tags := reg.Tags(t, "vms/stalled"); slices.Contains(tags, "snap") {
		t.Fatalf("a failed checkpoint left its tag: %v", tags)
	}

	// The pull side: staging an image from a registry that stalls its
	// blob downloads.
	good := cliJSON[api.CheckpointResult](t, with([]string{"checkpoint", "--qmp", src.vm.QMPPath(),
		"--image", reg.Host + "/vms/stalled:good", "--mode", "snapshot", "--chunk-size", "262144"}, regArgs(reg)...)...)
	px.stallReadsAfter.Store(2)
	staged := filepath.Join(t.TempDir(), "state")
	start := time.Now()
	doc = cliFail(t, with([]string{"restore", "--image", px.Host + "/vms/stalled@" + good.VMState.Digest, "--to-dir", staged,
		"--timeout", timeout.String()}, px.args()...)...)
	took = time.Since(start)
	t.Logf("stalled registry: staging failed after %v (%d blob reads went through) with %s: %s",
		took.Round(time.Millisecond), px.blobReads.Load(), doc.Error.Code, doc.Error.Message)
	if took < timeout-time.Second || took > timeout+stallGuard {
		t.Fatalf("staging from a stalled registry ended after %v with a %v timeout", took, timeout)
	}
	assertTimedOut(t, doc, timeout)
	if tmp := tempFiles(t, staged); len(tmp) > 0 {
		t.Fatalf("temporary files left: %v", tmp)
	}
	if ms := layoutManifests(t, staged); len(ms) > 0 {
		t.Fatalf("a failed staging names manifests in index.json: %v", ms)
	}
}

// assertTimedOut checks the error of a command that its --timeout ended
// while it waited for the registry.
func assertTimedOut(t *testing.T, doc api.ErrorDoc, timeout time.Duration) {
	t.Helper()
	if doc.Error.Code != errcode.RegistryError {
		t.Errorf("a command stuck on a stalled registry ended with %s, want REGISTRY_ERROR: %s", doc.Error.Code, doc.Error.Message)
	}
	for _, want := range []string{"--timeout of " + timeout.String() + " ran out", "waiting for the registry", "give it more time with --timeout"} {
		if !strings.Contains(doc.Error.Message, want) {
			t.Errorf("the error does not say %q: %s", want, doc.Error.Message)
		}
	}
}

// Without a caller's timeout, a registry that accepts an upload and then
// stalls must still fail the checkpoint within a bounded time, as
// REGISTRY_ERROR naming the registry, and continue the VM.
func TestFaultRegistryStallIsARegistryError(t *testing.T) {
	t.Parallel()
	// Each registry request has a deadline of its own (20 s plus the
	// transfer at 1 MiB/s), so a stalled registry is given up on after its
	// tries, not at the caller's 30-minute default.
	src, reg, px, doc, took := runStalledCheckpoint(t)
	if doc.Error.Code != errcode.RegistryError || !strings.Contains(doc.Error.Message, px.Host) {
		t.Fatalf("a stalled registry gave %s: %s; want REGISTRY_ERROR naming %s", doc.Error.Code, doc.Error.Message, px.Host)
	}
	if took > stallGuard {
		t.Fatalf("the checkpoint took %v to give up on a stalled registry", took)
	}
	src.assertRunning(t, "after a stalled registry")
	if tags := reg.Tags(t, "vms/stalled"); slices.Contains(tags, "snap") {
		t.Fatalf("a failed checkpoint left its tag: %v", tags)
	}
}

// --- 3. the staging disk is full ---

// tinyFS mounts a tmpfs of size bytes and returns its directory.
func tinyFS(t *testing.T, size string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("SKIP mounting a tmpfs needs root")
	}
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size="+size+",mode=0755"); err != nil {
		t.Skipf("SKIP cannot mount a tmpfs: %v", err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(dir, syscall.MNT_DETACH) })
	return dir
}

// fill leaves about free bytes of room on dir's filesystem.
func fill(t *testing.T, dir string, free int64) {
	t.Helper()
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	avail := int64(st.Bavail) * st.Bsize
	if avail <= free {
		return
	}
	if err := os.WriteFile(filepath.Join(dir, "filler"), bytes.Repeat([]byte{0xa5}, int(avail-free)), 0o644); err != nil {
		t.Fatal(err)
	}
}

// assertDiskFull checks the error of a command that filled the disk under
// dir: one code wherever that happens, and a message that names the place
// and says what to do.
func assertDiskFull(t *testing.T, doc api.ErrorDoc, dir string) {
	t.Helper()
	if doc.Error.Code != errcode.NoSpace {
		t.Errorf("a full disk reads as %s, want %s: %s", doc.Error.Code, errcode.NoSpace, doc.Error.Message)
	}
	for _, want := range []string{"no space left on device", "the filesystem holding " + dir, "is full: free space there, then try again"} {
		if !strings.Contains(doc.Error.Message, want) {
			t.Errorf("the error does not say %q: %s", want, doc.Error.Message)
		}
	}
}

func TestFaultStagingDiskFull(t *testing.T) {
	t.Parallel()
	srcDir, _, image, diskImage := checkpointOnce(t)

	t.Run("restore --to-dir", func(t *testing.T) {
		mnt := tinyFS(t, "1m")
		staged := filepath.Join(mnt, "state")
		start := time.Now()
		doc := cliFail(t, "restore", "--image", image, "--to-dir", staged)
		took := time.Since(start)
		files, size := countFiles(staged)
		t.Logf("staging into a 1 MiB tmpfs: %s after %v: %s; left %d complete files (%d bytes), no tag",
			doc.Error.Code, took.Round(time.Millisecond), doc.Error.Message, files, size)
		// The staging directory is an OCI layout, an image store, but a
		// full disk is a full disk: the same code as under an overlay.
		assertDiskFull(t, doc, staged)
		if tmp := tempFiles(t, mnt); len(tmp) > 0 {
			t.Fatalf("temporary files left: %v", tmp)
		}
		if ms := layoutManifests(t, staged); len(ms) > 0 {
			t.Fatalf("a failed staging names manifests in index.json: %v", ms)
		}
		// vmsnap stream refuses the partial staging.
		var out bytes.Buffer
		if code := runBinary(t, []string{"stream", "--dir", staged}, &out, io.Discard); code == 0 || out.Len() > 0 {
			t.Fatalf("vmsnap stream on a failed staging: exit %d, %d bytes on stdout", code, out.Len())
		}
	})

	t.Run("restore --disk", func(t *testing.T) {
		mnt := tinyFS(t, "1m")
		if err := os.Symlink(filepath.Join(srcDir, "base.qcow2"), filepath.Join(mnt, "base.qcow2")); err != nil {
			t.Fatal(err)
		}
		// The overlay holds a few clusters of 64 KiB: leave room for two.
		fill(t, mnt, 128<<10)
		disk := filepath.Join(mnt, "overlay.qcow2")
		start := time.Now()
		doc := cliFail(t, "restore", "--disk-image", diskImage, "--disk", disk)
		t.Logf("disk restore into a full tmpfs: %s after %v: %s", doc.Error.Code, time.Since(start).Round(time.Millisecond), doc.Error.Message)
		assertDiskFull(t, doc, mnt)
		if !strings.Contains(doc.Error.Message, "writing "+disk) {
			t.Errorf("the error does not name the overlay %s: %s", disk, doc.Error.Message)
		}
		if _, err := os.Lstat(disk); !os.IsNotExist(err) {
			t.Fatalf("a failed disk restore left %s (%v)", disk, err)
		}
		if tmp := tempFiles(t, mnt); len(tmp) > 0 {
			t.Fatalf("temporary files left: %v", tmp)
		}
	})
}

// --- 4. QEMU killed mid-checkpoint and mid-restore ---

func TestFaultQEMUKilled(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	reg := registry.Start(t)
	// 96 MiB of random guest memory: a stream of ~100 MiB, long enough to
	// kill QEMU in the middle of it.
	src := startFaultVM(t, guest.Options{GuestMemMB: 96})
	// A good image first, for the restore below.
	good := cliJSON[api.CheckpointResult](t, with([]string{"checkpoint", "--qmp", src.vm.QMPPath(),
		"--image", reg.Host + "/vms/killed:good", "--mode", "snapshot"}, regArgs(reg)...)...)
	src.assertRunning(t, "after a snapshot")

	t.Run("mid-checkpoint", func(t *testing.T) {
		store := filepath.Join(t.TempDir(), "store")
		blobs := filepath.Join(store, "blobs", "sha256")
		var killedAt atomic.Int64 // unix nanos
		var blobsAtKill atomic.Int32
		done := make(chan struct{})
		defer close(done)
		go func() {
			for {
				if n, _ := countFiles(blobs); n >= 3 {
					src.vm.Process().Kill() // SIGKILL
					killedAt.Store(time.Now().UnixNano())
					blobsAtKill.Store(int32(n))
					return
				}
				select {
				case <-done:
					return
				case <-time.After(2 * time.Millisecond):
				}
			}
		}()
		doc := cliFail(t, "checkpoint", "--qmp", src.vm.QMPPath(), "--image", "oci:"+store+":snap",
			"--mode", "snapshot", "--chunk-size", "262144")
		if killedAt.Load() == 0 {
			t.Fatalf("the checkpoint ended before QEMU was killed: %s: %s", doc.Error.Code, doc.Error.Message)
		}
		after := time.Since(time.Unix(0, killedAt.Load()))
		t.Logf("QEMU killed after %d blobs were stored; the checkpoint failed %v later with %s: %s",
			blobsAtKill.Load(), after.Round(time.Millisecond), doc.Error.Code, doc.Error.Message)
		if doc.Error.Code != errcode.QMPError {
			t.Errorf("QEMU killed mid-checkpoint gave %s, want QMP_ERROR", doc.Error.Code)
		}
		if !strings.Contains(doc.Error.Message, "QEMU") || !strings.Contains(doc.Error.Message, "could not be continued") {
			t.Errorf("the error does not say that QEMU went away and the VM could not be continued: %s", doc.Error.Message)
		}
		if after > 15*time.Second {
			t.Errorf("the checkpoint took %v to notice QEMU was gone", after)
		}
		src.assertGone(t)
		if ms := layoutManifests(t, store); len(ms) > 0 {
			t.Fatalf("a checkpoint of a killed QEMU names manifests in index.json: %v", ms)
		}
		if tmp := tempFiles(t, store); len(tmp) > 0 {
			t.Fatalf("temporary files left: %v", tmp)
		}
	})

	t.Run("mid-restore", func(t *testing.T) {
		// The restore reads through a proxy paced at 8 MB/s, so QEMU can be
		// killed while it loads.
		px := startFaultProxy(t, reg)
		px.limit = &faultLimiter{rate: 8e6}
		target := startFaultVM(t, guest.Options{Incoming: true})
		var killedAt atomic.Int64
		var loadedAtKill atomic.Int64
		done := make(chan struct{})
		defer close(done)
		go func() {
			for {
				var mig struct{ Status string }
				if target.qmp("query-migrate", &mig) == nil && mig.Status == "active" && px.bytesDown.Load() > 12<<20 {
					target.vm.Process().Kill()
					killedAt.Store(time.Now().UnixNano())
					loadedAtKill.Store(px.bytesDown.Load())
					return
				}
				select {
				case <-done:
					return
				case <-time.After(20 * time.Millisecond):
				}
			}
		}()
		image := px.Host + "/vms/killed@" + good.VMState.Digest
		doc := cliFail(t, with([]string{"restore", "--qmp", target.vm.QMPPath(), "--image", image}, px.args()...)...)
		if killedAt.Load() == 0 {
			t.Fatalf("the restore ended before QEMU was killed: %s: %s", doc.Error.Code, doc.Error.Message)
		}
		after := time.Since(time.Unix(0, killedAt.Load()))
		t.Logf("target QEMU killed while loading (%d of %d stored bytes fetched); the restore failed %v later with %s: %s",
			loadedAtKill.Load(), good.VMState.StoredBytes, after.Round(time.Millisecond), doc.Error.Code, doc.Error.Message)
		if doc.Error.Code != errcode.QMPError {
			t.Errorf("QEMU killed mid-restore gave %s, want QMP_ERROR", doc.Error.Code)
		}
		if !strings.Contains(doc.Error.Message, "QEMU") {
			t.Errorf("the error does not say QEMU went away: %s", doc.Error.Message)
		}
		if after > 10*time.Second {
			t.Errorf("the restore took %v to notice QEMU was gone", after)
		}
		// It stopped fetching: most of the image was never read.
		if got := px.bytesDown.Load(); got > good.VMState.StoredBytes*3/4 {
			t.Errorf("the restore fetched %d of %d bytes after QEMU died", got, good.VMState.StoredBytes)
		}
		target.assertGone(t)
	})
}

// --- 5. a target whose CPU differs under the same model name ---

// -cpu host on two hosts with different CPUs gives two vCPUs of one QOM type
// (host-x86_64-cpu) with different features, and a guest that used one of
// them would crash on the other. Under TCG, -cpu qemu64,+avx2 does the same
// on one host: the restore is refused before QEMU sees a byte, naming the
// feature.
func TestFaultTargetCPUFeaturesDiffer(t *testing.T) {
	t.Parallel()
	srcDir, _, image, diskImage := checkpointOnce(t)
	tdir := targetDir(t, srcDir)
	disk := filepath.Join(tdir, "overlay.qcow2")
	cliJSON[api.RestoreResult](t, "restore", "--disk-image", diskImage, "--disk", disk)
	target := guest.Start(t, guest.Options{Disk: disk, Dir: tdir, Incoming: true, ExtraArgs: []string{"-cpu", "qemu64,+avx2"}})
	doc := cliError(t, errcode.CompatMismatch, "restore", "--qmp", target.QMPPath(), "--image", image)
	if want := []string{"CPU features not in snapshot (CPUID 0x7.0:EBX): avx2 (bit 5)"}; !slices.Equal(doc.Error.Details, want) {
		t.Fatalf("the mismatch lists %q, want %q", doc.Error.Details, want)
	}
	if st := runState(t, target); st != "inmigrate" {
		t.Fatalf("target is %s after a refused restore, want inmigrate (untouched)", st)
	}
}

// --- 6. a slow registry: back-pressure, bounded memory ---

func TestFaultSlowRegistryBoundedMemory(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	bin := binary(t)
	reg := registry.Start(t)
	px := startFaultProxy(t, reg)
	const rate = 2e6 // bytes per second
	px.limit = &faultLimiter{rate: rate}
	src := startFaultVM(t, guest.Options{GuestMemMB: 64})

	args := with([]string{"checkpoint", "--qmp", src.vm.QMPPath(), "--image", px.Host + "/vms/slow:snap",
		"--mode", "snapshot", "--json"}, px.args()...)
	cmd := exec.Command(bin, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// The peak RSS of vmsnap's own address space, read while it runs:
	// rusage's Maxrss of a child is no good here, since Linux counts in it
	// the high-water RSS of the parent's address space that the child
	// shared (vfork) until its exec, and this test binary can be large.
	hwm, exited := make(chan int64), make(chan struct{})
	go func() {
		var peak int64
		for {
			if n := vmHWM(cmd.Process.Pid); n > peak {
				peak = n
			}
			select {
			case <-exited:
				hwm <- peak
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	err := cmd.Wait()
	took := time.Since(start)
	close(exited)
	rss := <-hwm
	if err != nil {
		t.Fatalf("checkpoint through a slow registry: %v\n%s%s", err, stderr.String(), stdout.String())
	}
	var cp api.CheckpointResult
	if err := json.Unmarshal(stdout.Bytes(), &cp); err != nil {
		t.Fatalf("no JSON result: %v\n%s", err, stdout.String())
	}
	maxrss := cmd.ProcessState.SysUsage().(*syscall.Rusage).Maxrss << 10 // KiB on Linux
	t.Logf("slow registry (%.0f MB/s): %s raw state, %s uploaded in %v (%.2f MB/s), peak RSS %s (VmHWM; rusage says %s), guest downtime %.0f ms",
		rate/1e6, humanBytes(cp.VMState.RawBytes), humanBytes(cp.VMState.UploadedBytes), took.Round(time.Millisecond),
		float64(cp.VMState.UploadedBytes)/took.Seconds()/1e6, humanBytes(rss), humanBytes(maxrss), cp.DowntimeMs)
	if rss == 0 {
		t.Fatal("could not read the checkpoint's VmHWM")
	}
	if cp.VMState.UploadedBytes < 60<<20 {
		t.Fatalf("only %d bytes uploaded: the guest's 64 MiB of random data should not compress", cp.VMState.UploadedBytes)
	}
	if min := time.Duration(float64(cp.VMState.UploadedBytes) / rate * 0.9 * float64(time.Second)); took < min {
		t.Fatalf("the checkpoint took %v, less than the %v the throttle allows: the proxy did not slow it", took, min)
	}
	if rss > 200<<20 {
		t.Fatalf("peak RSS %s while streaming %s into a slow registry: memory is not bounded", humanBytes(rss), humanBytes(cp.VMState.StoredBytes))
	}
	src.assertRunning(t, "after a checkpoint into a slow registry")
	if tags := reg.Tags(t, "vms/slow"); !slices.Contains(tags, "snap") {
		t.Fatalf("no tag after the checkpoint succeeded: %v", tags)
	}
}

// vmHWM is the peak resident set (bytes) of a running process's address
// space, 0 if it cannot be read (the process has exited).
func vmHWM(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			var kib int64
			fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kib)
			return kib << 10
		}
	}
	return 0
}
