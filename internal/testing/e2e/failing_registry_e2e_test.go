//go:build linux

package e2e

// Registries that misbehave on purpose, for the failure table
// (registry_failures_e2e_test.go): each is a small HTTPS server of the
// test's own on 127.0.0.1 in front of the real registry
// (internal/testing/registry), which answers for it or lets one kind of request
// go wrong; and two servers that are no registry at all (a closed port, a
// server that answers bytes that are not TLS or HTTP).

import (
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/testing/registry"
)

// registryFault is one way a registry fails.
type registryFault struct {
	name string
	// status, if not 0, answers every request for a repository with this
	// status, retryAfter (if set) and body, an error document in the
	// distribution API's form; with everywhere, /v2/ too.
	status     int
	retryAfter string
	body       string
	everywhere bool
	// blob, if set, is what happens to each blob's bytes, downloaded or
	// uploaded: stallBlob, truncateBlob or cutBlob.
	blob blobFault
}

type blobFault int

const (
	noBlobFault  blobFault = iota
	stallBlob              // half the bytes, then nothing: the connection stays open
	truncateBlob           // half the bytes, said to be all of it (Content-Length)
	cutBlob                // half the bytes of the length announced, then the connection closes
)

func registryError(code, msg string) string {
	return fmt.Sprintf(`{"errors":[{"code":%q,"message":%q}]}`, code, msg)
}

// startFaultyRegistry serves reg through fault on an address of its own
// and returns its host.
func startFaultyRegistry(t *testing.T, reg *registry.Registry, f registryFault, quit <-chan struct{}) *httptest.Server {
	t.Helper()
	target, _ := url.Parse("https://" + reg.Host)
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.Host = pr.In.Host // the registry's upload locations name this server
			if f.blob == truncateBlob && isUpload(pr.In) {
				half := pr.In.ContentLength / 2
				pr.Out.Body, pr.Out.ContentLength = io.NopCloser(io.LimitReader(pr.In.Body, half)), half
				pr.Out.Header.Set("Content-Length", strconv.FormatInt(half, 10))
			}
		},
		ModifyResponse: func(resp *http.Response) error {
			if f.blob != noBlobFault && isBlobDownload(resp.Request) && resp.StatusCode == http.StatusOK {
				misbehave(resp, f.blob, quit)
			}
			return nil
		},
		Transport:     reg.Transport(),
		FlushInterval: -1, // what is sent arrives: a stall mid-blob is seen as such
		ErrorLog:      log.New(io.Discard, "", 0),
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		repo := strings.HasPrefix(r.URL.Path, "/v2/") && r.URL.Path != "/v2/"
		switch {
		case f.status != 0 && (repo || f.everywhere):
			answer(w, f)
		case f.blob != noBlobFault && f.blob != truncateBlob && isUpload(r):
			breakUpload(r, f.blob, quit)
		default:
			rp.ServeHTTP(w, r)
		}
	}))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.StartTLS()
	t.Cleanup(func() { srv.CloseClientConnections(); srv.Close() })
	return srv
}

func answer(w http.ResponseWriter, f registryFault) {
	if f.retryAfter != "" {
		w.Header().Set("Retry-After", f.retryAfter)
	}
	if f.status == http.StatusUnauthorized {
		w.Header().Set("WWW-Authenticate", `Basic realm="faulty registry"`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(f.status)
	_, _ = io.WriteString(w, f.body)
}

// isUpload is a request that carries a blob's bytes: a PATCH of an upload
// session, or the PUT that completes one with the whole body.
func isUpload(r *http.Request) bool {
	return strings.Contains(r.URL.Path, "/blobs/uploads/") && (r.Method == http.MethodPatch || r.Method == http.MethodPut && r.ContentLength > 0)
}

func isBlobDownload(r *http.Request) bool {
	return r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/blobs/sha256:")
}

// misbehave makes a blob download's body fail as f says.
func misbehave(resp *http.Response, f blobFault, quit <-chan struct{}) {
	half := resp.ContentLength / 2
	body := &halfBody{r: resp.Body, left: half, fault: f, quit: quit, done: resp.Request.Context().Done()}
	if f == truncateBlob {
		resp.ContentLength = half
		resp.Header.Set("Content-Length", strconv.FormatInt(half, 10))
	}
	resp.Body = body
}

// halfBody passes on the first left bytes of r, then ends (truncate),
// fails (cut: the proxy drops the connection) or blocks until the client
// gives up or the test ends (stall).
type halfBody struct {
	r          io.ReadCloser
	left       int64
	fault      blobFault
	quit, done <-chan struct{}
}

func (b *halfBody) Read(p []byte) (int, error) {
	if b.left > 0 {
		n, err := b.r.Read(p[:min(int64(len(p)), b.left)])
		b.left -= int64(n)
		return n, err
	}
	switch b.fault {
	case truncateBlob:
		return 0, io.EOF
	case cutBlob:
		return 0, errors.New("cut on purpose")
	}
	select {
	case <-b.done:
	case <-b.quit:
	}
	return 0, errors.New("stalled on purpose")
}

func (b *halfBody) Close() error { return b.r.Close() }

// breakUpload reads half an upload's body, then stalls until the client
// gives up (stall) or drops the connection (cut), unanswered.
func breakUpload(r *http.Request, f blobFault, quit <-chan struct{}) {
	_, _ = io.CopyN(io.Discard, r.Body, r.ContentLength/2)
	if f == stallBlob {
		select {
		case <-r.Context().Done():
		case <-quit:
		}
	}
	panic(http.ErrAbortHandler) // drop the connection without an answer
}

// startNotHTTP listens on 127.0.0.1 and answers every connection with a
// line that is neither TLS nor HTTP, then closes it.
func startNotHTTP(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = io.WriteString(c, "SSH-2.0-OpenSSH_9.2p1 Debian-2\r\nnot a registry\r\n")
			c.Close()
		}
	}()
	return ln.Addr().String()
}

// closedPort is an address on 127.0.0.1 where nothing listens.
func closedPort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}
