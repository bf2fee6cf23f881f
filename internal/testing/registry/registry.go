// Package registry runs a real OCI registry for vmsnap's tests: Debian's
// docker-registry (distribution 2.8) on 127.0.0.1, on a free port, with TLS
// from a test CA made here and htpasswd (bcrypt) authentication, storing in a
// temporary directory. It writes what a client needs: the CA file (for
// --ca-file), a certificate directory (for skopeo --cert-dir), and Docker
// config directories with the right and with a wrong password (for
// --registry-config).
//
// When the registry or htpasswd is not installed the test is skipped with
// the reason, unless VMSNAP_TEST_REQUIRE_QEMU=1 (as in CI), which makes it
// fail: apt-get install docker-registry apache2-utils (make deps).
//
// The registry runs with Pdeathsig, so it dies with the test binary even if
// a timeout kills that before the cleanups run.
package registry

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"io/fs"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

// Binaries the harness runs.
const (
	RegistryBinary = "/usr/bin/docker-registry"
	HtpasswdBinary = "htpasswd"
)

// Registry is a running docker-registry. Its fields are fixed for its life,
// across Stop and Restart.
type Registry struct {
	// Host is 127.0.0.1:PORT, the registry part of image references.
	Host string
	// User and Password are the one account htpasswd accepts.
	User, Password string
	// CAFile is the test CA's certificate (PEM), for --ca-file.
	CAFile string
	// CertDir holds ca.crt, for skopeo --cert-dir.
	CertDir string
	// ConfigDir is a Docker config directory with the right credentials;
	// WrongConfigDir one with a wrong password for the same user.
	ConfigDir, WrongConfigDir string
	// AuthFile is ConfigDir/config.json (skopeo --authfile).
	AuthFile string
	// StorageDir is the registry's filesystem storage.
	StorageDir string

	t       testing.TB
	dir     string
	config  string
	logPath string
	roots   *x509.CertPool

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

// Option changes how Start configures the registry.
type Option func(*options)

type options struct {
	deletesDisabled bool
	ip              string
}

// WithDeletesDisabled runs the registry as distribution runs by default:
// storage.delete.enabled false, so that it refuses every delete (405
// UNSUPPORTED). Without it, deletes are enabled.
func WithDeletesDisabled() Option { return func(o *options) { o.deletesDisabled = true } }

// OnAddress makes the registry listen on ip, a local address, instead of
// 127.0.0.1: the gateway address of a test cluster's pod bridge, where pods
// reach it. Its certificate names ip as well as 127.0.0.1.
func OnAddress(ip string) Option { return func(o *options) { o.ip = ip } }

// Start runs a registry for t, stopped when t ends.
func Start(t testing.TB, opts ...Option) *Registry {
	t.Helper()
	o := options{ip: "127.0.0.1"}
	for _, opt := range opts {
		opt(&o)
	}
	requireTools(t)
	dir := t.TempDir()
	r := &Registry{
		t: t, dir: dir, User: "vmsnap", Password: randomString(t, 12),
		StorageDir: filepath.Join(dir, "storage"),
		CertDir:    filepath.Join(dir, "certs"),
		ConfigDir:  filepath.Join(dir, "docker"),
		logPath:    filepath.Join(dir, "registry.log"),
	}
	r.Host = net.JoinHostPort(o.ip, freePort(t, o.ip))
	for _, d := range []string{r.StorageDir, r.CertDir, r.ConfigDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	certFile, keyFile := r.makeCerts(t, net.ParseIP(o.ip))
	htpasswdFile := filepath.Join(dir, "htpasswd")
	// The password goes in on stdin, never in argv.
	cmd := exec.Command(HtpasswdBinary, "-iBc", htpasswdFile, r.User)
	cmd.Stdin = strings.NewReader(r.Password)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("htpasswd: %v\n%s", err, out)
	}
	r.AuthFile = r.writeDockerConfig(t, r.ConfigDir, r.Password)
	r.WrongConfigDir = filepath.Join(dir, "docker-wrong")
	if err := os.MkdirAll(r.WrongConfigDir, 0o700); err != nil {
		t.Fatal(err)
	}
	r.writeDockerConfig(t, r.WrongConfigDir, "not-"+r.Password)

	r.config = filepath.Join(dir, "config.yml")
	cfg := fmt.Sprintf(`version: 0.1
log:
  level: info
  formatter: text
storage:
  filesystem:
    rootdirectory: %s
  delete:
    enabled: %t
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: %s
  secret: %s
  tls:
    certificate: %s
    key: %s
  headers:
    X-Content-Type-Options: [nosniff]
auth:
  htpasswd:
    realm: vmsnap-test
    path: %s
`, r.StorageDir, !o.deletesDisabled, r.Host, randomString(t, 16), certFile, keyFile, htpasswdFile)
	if err := os.WriteFile(r.config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	r.start(t)
	t.Cleanup(func() {
		r.Stop()
		if t.Failed() {
			t.Logf("docker-registry log (tail):\n%s", r.LogTail(40))
		}
	})
	return r
}

func requireTools(t testing.TB) {
	t.Helper()
	var missing []string
	if _, err := os.Stat(RegistryBinary); err != nil {
		missing = append(missing, RegistryBinary+" (apt-get install docker-registry)")
	}
	if _, err := exec.LookPath(HtpasswdBinary); err != nil {
		missing = append(missing, HtpasswdBinary+" (apt-get install apache2-utils)")
	}
	if len(missing) == 0 {
		return
	}
	guest.SkipOrFail(t, "real-registry", "missing "+strings.Join(missing, ", ")+"; run make deps")
}

// start runs the registry and waits until it answers /v2/.
func (r *Registry) start(t testing.TB) {
	t.Helper()
	logf, err := os.OpenFile(r.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(RegistryBinary, "serve", r.config)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = registryEnv()
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		t.Fatalf("starting %s: %v", RegistryBinary, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(done)
	}()
	r.mu.Lock()
	r.cmd, r.done = cmd, done
	r.mu.Unlock()

	client := r.client(2 * time.Second)
	deadline := time.Now().Add(20 * time.Second)
	for {
		select {
		case <-done:
			t.Fatalf("docker-registry exited at start:\n%s", r.LogTail(30))
		default:
		}
		resp, err := client.Get("https://" + r.Host + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			r.Kill()
			t.Fatalf("docker-registry did not answer /v2/ within 20s (last: %v):\n%s", err, r.LogTail(30))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// registryEnv is the test's environment without REGISTRY_* variables, which
// would override the configuration file.
func registryEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "REGISTRY_") {
			env = append(env, kv)
		}
	}
	return env
}

// Stop ends the registry gracefully (SIGTERM, then SIGKILL after 10 s) and
// waits for it. Stopping a stopped registry does nothing.
func (r *Registry) Stop() { r.signal(syscall.SIGTERM, 10*time.Second) }

// Kill ends the registry at once (SIGKILL), as a crash would, and waits
// for it.
func (r *Registry) Kill() { r.signal(syscall.SIGKILL, 0) }

func (r *Registry) signal(sig syscall.Signal, grace time.Duration) {
	r.mu.Lock()
	cmd, done := r.cmd, r.done
	r.mu.Unlock()
	if cmd == nil {
		return
	}
	select {
	case <-done:
		return
	default:
	}
	_ = cmd.Process.Signal(sig)
	if grace > 0 {
		select {
		case <-done:
			return
		case <-time.After(grace):
			_ = cmd.Process.Kill()
		}
	}
	<-done
}

// Running reports whether the registry process is alive.
func (r *Registry) Running() bool {
	r.mu.Lock()
	done := r.done
	r.mu.Unlock()
	select {
	case <-done:
		return false
	default:
		return true
	}
}

// Restart starts a stopped (or killed) registry again on the same port and
// storage.
func (r *Registry) Restart(t testing.TB) {
	t.Helper()
	r.Stop()
	r.start(t)
}

// LogTail returns the last n lines of the registry's log.
func (r *Registry) LogTail(n int) string {
	b, _ := os.ReadFile(r.logPath)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// BlobCount is the number of blobs in the registry's storage (complete
// uploads only).
func (r *Registry) BlobCount() int {
	n := 0
	root := filepath.Join(r.StorageDir, "docker", "registry", "v2", "blobs")
	_ = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && d.Name() == "data" {
			n++
		}
		return nil
	})
	return n
}

// Tags lists the tags of repo, with the right credentials; a repository the
// registry does not know has none.
func (r *Registry) Tags(t testing.TB, repo string) []string {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, "https://"+r.Host+"/v2/"+repo+"/tags/list", nil)
	req.SetBasicAuth(r.User, r.Password)
	resp, err := r.client(10 * time.Second).Do(req)
	if err != nil {
		t.Fatalf("listing tags of %s: %v", repo, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode == http.StatusNotFound {
		return nil
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("listing tags of %s: %s: %s", repo, resp.Status, body)
	}
	var list struct{ Tags []string }
	if err := json.Unmarshal(body, &list); err != nil {
		t.Fatalf("tags of %s: %v: %s", repo, err, body)
	}
	return list.Tags
}

// client trusts the test CA.
func (r *Registry) client(timeout time.Duration) *http.Client {
	return &http.Client{Timeout: timeout, Transport: r.Transport()}
}

// Transport reaches the registry, trusting the test CA: for a test's own
// proxy in front of it.
func (r *Registry) Transport() *http.Transport {
	return &http.Transport{
		TLSClientConfig:     &tls.Config{RootCAs: r.roots, MinVersion: tls.VersionTLS12},
		MaxIdleConnsPerHost: 64,
	}
}

// writeDockerConfig writes dir/config.json with the user and password for
// the registry and returns its path.
func (r *Registry) writeDockerConfig(t testing.TB, dir, password string) string {
	t.Helper()
	auth := base64.StdEncoding.EncodeToString([]byte(r.User + ":" + password))
	b, _ := json.Marshal(map[string]any{"auths": map[string]any{r.Host: map[string]string{"auth": auth}}})
	p := filepath.Join(dir, "config.json")
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// makeCerts writes a test CA (CAFile, CertDir/ca.crt) and a server
// certificate for 127.0.0.1, localhost and ip signed by it.
func (r *Registry) makeCerts(t testing.TB, ip net.IP) (certFile, keyFile string) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "vmsnap test CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(48 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	srvKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	srvTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "127.0.0.1"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(48 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:     []string{"localhost"},
	}
	if ip != nil && !ip.IsLoopback() {
		srvTmpl.IPAddresses = append(srvTmpl.IPAddresses, ip)
	}
	srvDER, err := x509.CreateCertificate(rand.Reader, srvTmpl, caCert, &srvKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(srvKey)
	if err != nil {
		t.Fatal(err)
	}
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})
	r.CAFile = filepath.Join(r.dir, "ca.pem")
	certFile = filepath.Join(r.dir, "server.crt")
	keyFile = filepath.Join(r.dir, "server.key")
	for path, data := range map[string][]byte{
		r.CAFile:                           caPEM,
		filepath.Join(r.CertDir, "ca.crt"): caPEM,
		certFile:                           pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srvDER}),
		keyFile:                            pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}),
	} {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	r.roots = x509.NewCertPool()
	r.roots.AddCert(caCert)
	return certFile, keyFile
}

func freePort(t testing.TB, ip string) string {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, port, _ := net.SplitHostPort(l.Addr().String())
	return port
}

func randomString(t testing.TB, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// Skopeo runs skopeo with args and returns its stdout; it skips (or, with
// VMSNAP_TEST_REQUIRE_QEMU=1, fails) when skopeo is not installed.
func Skopeo(t testing.TB, ctx context.Context, args ...string) ([]byte, error) {
	t.Helper()
	if _, err := exec.LookPath("skopeo"); err != nil {
		guest.SkipOrFail(t, "skopeo", "skopeo not installed (apt-get install skopeo; make deps)")
	}
	cmd := exec.CommandContext(ctx, "skopeo", args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), fmt.Errorf("skopeo %s: %v: %s", strings.Join(args, " "), err, stderr.String())
	}
	return stdout.Bytes(), nil
}

// Pid is the registry process's id (0 before it started).
func (r *Registry) Pid() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cmd == nil || r.cmd.Process == nil {
		return 0
	}
	return r.cmd.Process.Pid
}

// Remote is what go-containerregistry's client needs to read from the
// registry: its CA and the right credentials.
func (r *Registry) Remote() []remote.Option {
	return []remote.Option{
		remote.WithAuth(&authn.Basic{Username: r.User, Password: r.Password}),
		remote.WithTransport(r.client(30 * time.Second).Transport),
	}
}
