//go:build linux

package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// The peer-credential tests run clients as other users: the test binary
// re-executes itself (TestPeerCredChild) with syscall.Credential, which
// needs root.

const (
	peerChildSocket = "VMSNAP_PEERCRED_SOCKET"
	peerChildMode   = "VMSNAP_PEERCRED_MODE" // "request" (default) or "silent"
	peerResultMark  = "PEERCRED-RESULT: "
	peerConnected   = "PEERCRED-CONNECTED"
	socketGID       = 4242 // the socket's group in these tests
	nobody          = 65534
)

// childResult is what a child client saw.
type childResult struct {
	UID    int   `json:"uid"`
	Groups []int `json:"groups"`
	// GET /v1/operations and POST /v1/checkpoints, raw.
	GetStatus  int    `json:"getStatus"`
	GetCode    string `json:"getCode"`
	GetMessage string `json:"getMessage"`
	PostStatus int    `json:"postStatus"`
	PostCode   string `json:"postCode"`
	// Client.List, as a Job would call it.
	ClientCode string  `json:"clientCode"`
	ClientErr  string  `json:"clientErr"`
	Ms         float64 `json:"ms"`
	// silent mode: how long until the agent closed a connection that sent
	// nothing, when (wall clock, shared with the parent), and whether the
	// agent closed it (EOF) rather than the child's own deadline.
	ClosedAfterMs float64 `json:"closedAfterMs"`
	ClosedAt      int64   `json:"closedAt"` // Unix nanoseconds
	ClosedByAgent bool    `json:"closedByAgent"`
	DialErr       string  `json:"dialErr"`
}

// TestPeerCredChild is not a test: it is the client side of the tests
// below, run in a child process as another user.
func TestPeerCredChild(t *testing.T) {
	socket := os.Getenv(peerChildSocket)
	if socket == "" {
		t.Skip("helper process of TestPeerCred*: runs only as their child")
	}
	var r childResult
	r.UID = os.Getuid()
	r.Groups, _ = os.Getgroups()
	start := time.Now()
	if os.Getenv(peerChildMode) == "silent" {
		c, err := net.Dial("unix", socket)
		if err != nil {
			r.DialErr = err.Error()
		} else {
			fmt.Printf("\n%s\n", peerConnected)
			// A guard against a hang only: the agent closes long before.
			_ = c.SetDeadline(time.Now().Add(2 * time.Minute))
			_, err := io.Copy(io.Discard, c)
			r.ClosedAfterMs = float64(time.Since(start)) / float64(time.Millisecond)
			r.ClosedAt, r.ClosedByAgent = time.Now().UnixNano(), err == nil
			c.Close()
		}
		printResult(r)
		return
	}
	c, err := NewClient("unix://" + socket)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	rawCall := func(method, path, body string) (int, api.ErrorDoc, error) {
		req, _ := http.NewRequestWithContext(ctx, method, "http://agent"+path, strings.NewReader(body))
		resp, err := c.http.Do(req)
		if err != nil {
			return 0, api.ErrorDoc{}, err
		}
		defer resp.Body.Close()
		var doc api.ErrorDoc
		b, _ := io.ReadAll(resp.Body)
		_ = json.Unmarshal(b, &doc)
		return resp.StatusCode, doc, nil
	}
	st, doc, err := rawCall(http.MethodGet, "/v1/operations", "")
	if err != nil {
		r.DialErr = err.Error()
	}
	r.GetStatus, r.GetCode, r.GetMessage = st, string(doc.Error.Code), doc.Error.Message
	// A request with a body the agent never reads when it refuses.
	body := `{"vm":{"podUID":"x","container":"qemu","qmp":"/q"},"image":"oci:/tmp/x:t","mode":"` + strings.Repeat("p", 30<<10) + `"}`
	st, doc, err = rawCall(http.MethodPost, "/v1/checkpoints", body)
	if err != nil && r.DialErr == "" {
		r.DialErr = err.Error()
	}
	r.PostStatus, r.PostCode = st, string(doc.Error.Code)
	cstart := time.Now()
	if _, err := c.List(ctx); err != nil {
		r.ClientCode, r.ClientErr = string(errcode.Of(err)), err.Error()
	}
	r.Ms = float64(time.Since(cstart)) / float64(time.Millisecond)
	printResult(r)
}

func printResult(r childResult) {
	b, _ := json.Marshal(r)
	fmt.Printf("\n%s%s\n", peerResultMark, b)
}

// testBinaryForOthers copies the test binary where any user may run it
// (go test's build directory is private to its user).
func testBinaryForOthers(t *testing.T) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "vmsnap-peercred-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	in, err := os.Open(self)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	p := filepath.Join(dir, "agent.test")
	out, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	return p
}

// runClientAs runs TestPeerCredChild as uid/gid with groups against socket.
func runClientAs(t *testing.T, bin, socket, mode string, uid, gid uint32, groups []uint32) (childResult, int) {
	t.Helper()
	cmd := exec.Command(bin, "-test.run=^TestPeerCredChild$", "-test.count=1")
	cmd.Dir = filepath.Dir(bin)
	cmd.Env = append(os.Environ(), peerChildSocket+"="+socket, peerChildMode+"="+mode)
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Credential: &syscall.Credential{Uid: uid, Gid: gid, Groups: groups},
		Pdeathsig:  syscall.SIGKILL,
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting the client as uid %d: %v", uid, err)
	}
	pid := cmd.Process.Pid
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("client as uid %d: %v\n%s%s", uid, err, stdout.String(), stderr.String())
		}
	case <-time.After(60 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("client as uid %d hung:\n%s%s", uid, stdout.String(), stderr.String())
	}
	sc := bufio.NewScanner(&stdout)
	for sc.Scan() {
		if s, ok := strings.CutPrefix(sc.Text(), peerResultMark); ok {
			var r childResult
			if err := json.Unmarshal([]byte(s), &r); err != nil {
				t.Fatal(err)
			}
			if r.UID != int(uid) {
				t.Fatalf("the child ran as uid %d, want %d", r.UID, uid)
			}
			return r, pid
		}
	}
	t.Fatalf("the client printed no result:\n%s%s", stdout.String(), stderr.String())
	return childResult{}, 0
}

// syncBuffer collects the agent's log.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startGroupAgent runs an agent whose socket belongs to group socketGID.
// With open, the socket's directory and mode let anyone connect, so that
// only the peer-credential check stands between other users and the API.
func startGroupAgent(t *testing.T, open bool) (socket string, log *syncBuffer, stop func()) {
	t.Helper()
	dir, err := os.MkdirTemp("", "vmsnap-peercred-sock-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	// Others may traverse the directory (as a hostPath mount usually
	// allows); the socket's own mode is the gate.
	if err := os.Chmod(dir, 0o711); err != nil {
		t.Fatal(err)
	}
	socket = filepath.Join(dir, "agent.sock")
	log = &syncBuffer{}
	srv, err := New(context.Background(), Config{
		Socket: socket, SocketGroup: strconv.Itoa(socketGID), StateDir: t.TempDir(), Resolver: newStaticResolver(),
		Logger: slog.New(slog.NewJSONHandler(log, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	client, _ := NewClient(socket)
	deadline := time.Now().Add(5 * time.Second)
	for client.Health(context.Background()) != nil {
		if time.Now().After(deadline) {
			t.Fatal("agent did not come up")
		}
		time.Sleep(10 * time.Millisecond)
	}
	fi, err := os.Stat(socket)
	if err != nil {
		t.Fatal(err)
	}
	if st := fi.Sys().(*syscall.Stat_t); st.Gid != socketGID || fi.Mode().Perm() != 0o660 {
		t.Fatalf("socket gid %d mode %v, want %d and 0660", st.Gid, fi.Mode().Perm(), socketGID)
	}
	if open {
		if err := os.Chmod(socket, 0o666); err != nil {
			t.Fatal(err)
		}
	}
	stopped := false
	stop = func() {
		if !stopped {
			stopped = true
			cancel()
			<-done
		}
	}
	t.Cleanup(stop)
	return socket, log, stop
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("running clients as other users needs root")
	}
}

// assertAccepted checks that a child got real answers.
func assertAccepted(t *testing.T, who string, r childResult) {
	t.Helper()
	if r.DialErr != "" || r.GetStatus != http.StatusOK || r.ClientErr != "" {
		t.Fatalf("%s was not served: %+v", who, r)
	}
	// Its checkpoint request reached the API (and was judged on its merits).
	if r.PostStatus == http.StatusForbidden || r.PostCode == string(errcode.AuthFailed) {
		t.Fatalf("%s: POST refused: %+v", who, r)
	}
}

// assertRefused checks that a child got a clear AUTH_FAILED at once.
func assertRefused(t *testing.T, who string, r childResult, log *syncBuffer, pid int) {
	t.Helper()
	if r.DialErr != "" {
		t.Fatalf("%s: the connection broke instead of an answer: %s", who, r.DialErr)
	}
	if r.GetStatus != http.StatusForbidden || r.GetCode != string(errcode.AuthFailed) || r.PostStatus != http.StatusForbidden || r.PostCode != string(errcode.AuthFailed) {
		t.Fatalf("%s: got GET %d %s, POST %d %s; want 403 AUTH_FAILED", who, r.GetStatus, r.GetCode, r.PostStatus, r.PostCode)
	}
	if !strings.Contains(r.GetMessage, fmt.Sprintf("uid %d", nobody)) || !strings.Contains(r.GetMessage, fmt.Sprintf("gid %d", socketGID)) {
		t.Fatalf("%s: the message does not say who was refused and who may call: %q", who, r.GetMessage)
	}
	if r.ClientCode != string(errcode.AuthFailed) || r.Ms > 2000 {
		t.Fatalf("%s: Client.List: %s %q after %.0f ms; want AUTH_FAILED at once", who, r.ClientCode, r.ClientErr, r.Ms)
	}
	want := fmt.Sprintf(`"pid":%d,"uid":%d,"gid":%d`, pid, nobody, nobody)
	for _, line := range strings.Split(log.String(), "\n") {
		if strings.Contains(line, "refused a caller") && strings.Contains(line, want) && strings.Contains(line, `"level":"WARN"`) {
			return
		}
	}
	t.Fatalf("%s: the agent's log has no refusal with %s:\n%s", who, want, log.String())
}

func TestPeerCredRefusesOtherUsers(t *testing.T) {
	requireRoot(t)
	bin := testBinaryForOthers(t)
	socket, log, _ := startGroupAgent(t, true)

	r, pid := runClientAs(t, bin, socket, "request", nobody, nobody, nil)
	assertRefused(t, "uid 65534 outside the socket group", r, log, pid)
	t.Logf("refused caller saw: %s (Client.List: %s in %.1f ms)", r.GetMessage, r.ClientErr, r.Ms)

	r, _ = runClientAs(t, bin, socket, "request", nobody, nobody, []uint32{100, socketGID})
	assertAccepted(t, "uid 65534 with the socket group as a supplementary group", r)
	r, _ = runClientAs(t, bin, socket, "request", nobody, socketGID, nil)
	assertAccepted(t, "uid 65534 with the socket group as its primary group", r)
	r, _ = runClientAs(t, bin, socket, "request", 0, 0, nil)
	assertAccepted(t, "root in a child process", r)
	// And the test process itself (root).
	c, _ := NewClient(socket)
	if _, err := c.List(context.Background()); err != nil {
		t.Fatalf("root: %v", err)
	}
}

// Without loosened permissions the socket's mode keeps non-members out
// already, and lets members in.
func TestPeerCredWithSocketMode(t *testing.T) {
	requireRoot(t)
	bin := testBinaryForOthers(t)
	socket, _, _ := startGroupAgent(t, false)
	r, _ := runClientAs(t, bin, socket, "request", nobody, nobody, nil)
	if !strings.Contains(r.DialErr, "permission denied") {
		t.Fatalf("a non-member reached a 0660 socket: %+v", r)
	}
	r, _ = runClientAs(t, bin, socket, "request", nobody, nobody, []uint32{socketGID})
	assertAccepted(t, "a member through the socket's mode", r)
}

// A refused caller that sends nothing is disconnected after the refusal
// timeout, and does not hold up anyone else meanwhile: requests made once it
// is connected are all answered before it is disconnected (a refusal that
// blocked the agent would hold them until then).
func TestPeerCredSilentRefusedCallerDoesNotBlock(t *testing.T) {
	requireRoot(t)
	bin := testBinaryForOthers(t)
	socket, _, _ := startGroupAgent(t, true)
	connected, res := runSilentChild(t, bin, socket, nobody, nobody)
	select {
	case <-connected:
	case r := <-res:
		t.Fatalf("the silent child ended before it connected: %+v", r)
	}
	c, _ := NewClient(socket)
	for range 20 {
		if _, err := c.List(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	served := time.Now().UnixNano()
	r := <-res
	if r.DialErr != "" || !r.ClosedByAgent || r.ClosedAfterMs < float64(refusalTimeout/time.Millisecond)/2 {
		t.Fatalf("silent refused caller: %+v; want it closed by the agent after about %v", r, refusalTimeout)
	}
	if served >= r.ClosedAt {
		t.Fatalf("20 requests were answered only %v after the silent refused caller was disconnected: the refusal held them", time.Duration(served-r.ClosedAt))
	}
	t.Logf("a silent refused caller was disconnected after %.0f ms", r.ClosedAfterMs)
}

// runSilentChild runs TestPeerCredChild in silent mode as uid/gid: connected
// is closed once it has connected, and its result arrives on res.
func runSilentChild(t *testing.T, bin, socket string, uid, gid uint32) (connected <-chan struct{}, res <-chan childResult) {
	t.Helper()
	cmd := exec.Command(bin, "-test.run=^TestPeerCredChild$", "-test.count=1")
	cmd.Dir = filepath.Dir(bin)
	cmd.Env = append(os.Environ(), peerChildSocket+"="+socket, peerChildMode+"=silent")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid}, Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	conn, results := make(chan struct{}), make(chan childResult, 1)
	go func() {
		// t.Fatal is not for other goroutines: report through the channel.
		r := childResult{DialErr: "child printed no result"}
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if sc.Text() == peerConnected {
				close(conn)
			} else if s, ok := strings.CutPrefix(sc.Text(), peerResultMark); ok {
				r = childResult{}
				if err := json.Unmarshal([]byte(s), &r); err != nil {
					r.DialErr = "child result: " + err.Error()
				}
			}
		}
		if err := cmd.Wait(); err != nil && r.DialErr == "" {
			r.DialErr = "child: " + err.Error()
		}
		results <- r
	}()
	return conn, results
}

// The /proc fallback (kernels without SO_PEERGROUPS) decides the same.
func TestPeerCredProcFallback(t *testing.T) {
	requireRoot(t)
	bin := testBinaryForOthers(t)
	saved := peerGroupsFunc
	var calls sync.Map
	peerGroupsFunc = func(fd int, p peer, accepted time.Time) ([]uint32, string, error) {
		calls.Store(p.pid, true)
		g, err := procGroups(p, accepted)
		return g, "/proc", err
	}
	socket, log, stop := startGroupAgent(t, true)
	defer func() { stop(); peerGroupsFunc = saved }()

	r, pid := runClientAs(t, bin, socket, "request", nobody, nobody, nil)
	assertRefused(t, "uid 65534 outside the group (/proc)", r, log, pid)
	r, pid = runClientAs(t, bin, socket, "request", nobody, nobody, []uint32{socketGID})
	assertAccepted(t, "uid 65534 in the group (/proc)", r)
	if _, ok := calls.Load(int32(pid)); !ok {
		t.Fatal("the fallback was not used")
	}
}

// procGroups refuses a pid that another process has taken since connect().
func TestProcGroupsDetectsPIDReuse(t *testing.T) {
	self := peer{pid: int32(os.Getpid()), uid: uint32(os.Geteuid()), gid: uint32(os.Getegid())}
	groups, err := procGroups(self, time.Now())
	if err != nil {
		t.Fatalf("own process: %v", err)
	}
	want, _ := os.Getgroups()
	if len(groups) != len(want) {
		t.Fatalf("groups %v, want %v", groups, want)
	}
	// Another user's process now holds the pid.
	other := self
	other.uid++
	if _, err := procGroups(other, time.Now()); err == nil || !strings.Contains(err.Error(), "reused") {
		t.Fatalf("a pid held by another uid: %v", err)
	}
	other = self
	other.gid++
	if _, err := procGroups(other, time.Now()); err == nil || !strings.Contains(err.Error(), "reused") {
		t.Fatalf("a pid held by another gid: %v", err)
	}
	// A process that started after the connection was accepted.
	accepted := time.Now()
	time.Sleep(50 * time.Millisecond)
	cmd := exec.Command("sleep", "5")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	late := peer{pid: int32(cmd.Process.Pid), uid: uint32(os.Geteuid()), gid: uint32(os.Getegid())}
	if _, err := procGroups(late, accepted); err == nil || !strings.Contains(err.Error(), "started after") {
		t.Fatalf("a process younger than the connection: %v", err)
	}
	if _, err := procGroups(late, time.Now()); err != nil {
		t.Fatalf("the same process for a connection accepted after it started: %v", err)
	}
	if _, err := procGroups(peer{pid: 0}, time.Now()); err == nil {
		t.Fatal("pid 0 accepted")
	}
}

func TestPeerPolicy(t *testing.T) {
	pol := peerPolicy{selfUID: 1000, group: 4242}
	for _, tc := range []struct {
		p    peer
		want bool
	}{
		{peer{uid: 0, gid: 0}, true},
		{peer{uid: 1000, gid: 1000}, true},
		{peer{uid: 1001, gid: 4242}, true},
		{peer{uid: 1001, gid: 1001, groups: []uint32{27, 4242}}, true},
		{peer{uid: 1001, gid: 1001, groups: []uint32{27, 4243}}, false},
		{peer{uid: 65534, gid: 65534}, false},
	} {
		if got := pol.allows(tc.p); got != tc.want {
			t.Errorf("%+v: allowed %v, want %v", tc.p, got, tc.want)
		}
	}
}

// SO_PEERGROUPS reports the groups a peer had at connect().
func TestSOPeerGroups(t *testing.T) {
	a, b, err := socketPair()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	defer b.Close()
	raw, _ := a.(*net.UnixConn).SyscallConn()
	var groups []uint32
	var gerr error
	_ = raw.Control(func(fd uintptr) { groups, gerr = soPeerGroups(int(fd)) })
	if gerr != nil {
		t.Skipf("SO_PEERGROUPS unsupported here: %v", gerr)
	}
	want, _ := os.Getgroups()
	if len(groups) != len(want) {
		t.Fatalf("SO_PEERGROUPS %v, getgroups %v", groups, want)
	}
}

func socketPair() (net.Conn, net.Conn, error) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		return nil, nil, err
	}
	fa, fb := os.NewFile(uintptr(fds[0]), "a"), os.NewFile(uintptr(fds[1]), "b")
	defer fa.Close()
	defer fb.Close()
	a, err := net.FileConn(fa)
	if err != nil {
		return nil, nil, err
	}
	b, err := net.FileConn(fb)
	if err != nil {
		a.Close()
		return nil, nil, err
	}
	return a, b, nil
}
