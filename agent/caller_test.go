//go:build linux

package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

func TestCgroupContainerIDs(t *testing.T) {
	id1, id2 := strings.Repeat("a1", 32), strings.Repeat("0f", 32)
	for name, tc := range map[string]struct {
		cgroup string
		want   []string
	}{
		"cgroupfs v1":         {"12:memory:/kubepods/burstable/pod3f2c/" + id1 + "\n11:pids:/kubepods/burstable/pod3f2c/" + id1 + "\n0::/\n", []string{id1}},
		"systemd v2":          {"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod3f2c.slice/cri-containerd-" + id1 + ".scope\n", []string{id1}},
		"containerd":          {"0::/k8s.io/" + id1 + "\n", []string{id1}},
		"innermost first":     {"0::/" + id2 + "/" + id1 + "\n", []string{id1, id2}},
		"the host":            {"0::/init.scope\n4:memory:/process_api/c4364545ebf1369913f537186f2e8543\n", nil},
		"not hex":             {"0::/k8s.io/" + strings.Repeat("g", 64) + "\n", nil},
		"upper case":          {"0::/k8s.io/" + strings.ToUpper(id1) + "\n", nil},
		"63 digits":           {"0::/k8s.io/" + id1[1:] + "\n", nil},
		"glued":               {"0::/k8s.io/x" + id1 + "\n", nil},
		"a colon in the path": {"0::/a:b/" + id1 + "\n", []string{id1}},
	} {
		if got := cgroupContainerIDs([]byte(tc.cgroup)); !slices.Equal(got, tc.want) {
			t.Errorf("%s: %v, want %v", name, got, tc.want)
		}
	}
	var many strings.Builder
	many.WriteString("0::")
	for i := range 20 {
		many.WriteString("/" + strings.Repeat("0", 62) + string(rune('a'+i%6)) + string(rune('a'+i/6)))
	}
	if got := cgroupContainerIDs([]byte(many.String())); len(got) != maxCandidates {
		t.Errorf("%d candidates from a deep cgroup, want at most %d", len(got), maxCandidates)
	}
}

// A caller the agent cannot see, or whose pid another process took after
// the connection was accepted, is refused.
func TestIdentifyRefusesUnseenOrReusedPIDs(t *testing.T) {
	s := fuzzServer(t)
	if _, err := s.identifyPeer(context.Background(), peer{pid: 0}, time.Now()); errcode.Of(err) != errcode.Forbidden {
		t.Fatalf("pid 0: %v, want FORBIDDEN", err)
	}
	// This process "connected" before it started: a reused pid.
	if _, err := s.identifyPeer(context.Background(), peer{pid: int32(os.Getpid())}, time.Now().Add(-24*time.Hour*365)); errcode.Of(err) != errcode.Forbidden ||
		!strings.Contains(err.Error(), "reused") {
		t.Fatalf("a pid that started after the accept: %v, want FORBIDDEN naming the reuse", err)
	}
	c, err := s.identifyPeer(context.Background(), peer{pid: int32(os.Getpid())}, time.Now())
	if err != nil || !c.Admin || c.Namespace != "" {
		t.Fatalf("this test, a process on the node outside any container: %+v, %v; want an admin", c, err)
	}
}

// tenants is an agent whose static resolver has a VM in tenant-a and one
// in tenant-b, served to callers the test names.
type tenants struct {
	s      *Server
	h      http.Handler
	vmA    *qmptest.FakeQEMU
	vmB    *qmptest.FakeQEMU
	layout string
}

const uidA, uidB = "6f1c2a4e-aaaa-4c0e-9a51-0123456789ab", "6f1c2a4e-bbbb-4c0e-9a51-0123456789ab"

func newTenants(t *testing.T) *tenants {
	res := newStaticResolver()
	tn := &tenants{vmA: qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20)), vmB: qmptest.NewFakeQEMU(t, "running", randomState(t, 1<<20))}
	res.vms[uidA] = api.Target{PodUID: uidA, Container: "qemu", ContainerID: "c-a", QMPPath: tn.vmA.Path(), Namespace: "tenant-a"}
	res.vms[uidB] = api.Target{PodUID: uidB, Container: "qemu", ContainerID: "c-b", QMPPath: tn.vmB.Path(), Namespace: "tenant-b"}
	tn.layout = t.TempDir()
	s, err := New(context.Background(), Config{StateDir: t.TempDir(), Resolver: res, LayoutRoot: tn.layout, MaxConcurrent: 1,
		AdminNamespaces: []string{"platform"}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	tn.s, tn.h = s, s.Handler()
	return tn
}

// do sends a request as caller and returns the status and body.
func (tn *tenants) do(caller Caller, method, path, body string) (int, []byte) {
	req := httptest.NewRequest(method, path, strings.NewReader(body))
	req = req.WithContext(withCaller(req.Context(), caller))
	rec := httptest.NewRecorder()
	tn.h.ServeHTTP(rec, req)
	return rec.Code, rec.Body.Bytes()
}

func (tn *tenants) checkpoint(t *testing.T, caller Caller, uid string) (api.Operation, api.Error) {
	t.Helper()
	// Each caller's layouts are under its namespace's directory (policy.go).
	body := `{"vm":{"podUID":"` + uid + `","container":"qemu","qmp":"/run/vm/qmp.sock"},"image":"oci:` + tn.layout + `/` + caller.Namespace + `/` + uid + `:t"}`
	code, b := tn.do(caller, "POST", "/v1/checkpoints", body)
	var o api.Operation
	var e api.ErrorDoc
	if code == http.StatusAccepted {
		_ = json.Unmarshal(b, &o)
	} else {
		_ = json.Unmarshal(b, &e)
	}
	return o, e.Error
}

var (
	callerA     = Caller{Namespace: "tenant-a", Pod: "job", Container: "vmsnap", PID: 10}
	callerB     = Caller{Namespace: "tenant-b", Pod: "job", Container: "vmsnap", PID: 11}
	callerAdmin = Caller{Namespace: "platform", Admin: true, PID: 12}
)

func TestCallerActsOnlyInItsNamespace(t *testing.T) {
	tn := newTenants(t)
	tn.s.slots <- struct{}{} // operations stay pending: nothing reaches a VM by itself
	defer func() { <-tn.s.slots }()

	// tenant-b asks for tenant-a's VM: FORBIDDEN, and the VM hears nothing.
	if _, e := tn.checkpoint(t, callerB, uidA); e.Code != errcode.Forbidden || !strings.Contains(e.Message, "own namespace tenant-b") {
		t.Fatalf("tenant-b checkpointing tenant-a's VM: %+v, want FORBIDDEN", e)
	}
	if cmds := tn.vmA.Commands(); len(cmds) != 0 {
		t.Fatalf("tenant-a's VM received %v from a refused request", cmds)
	}
	if entries, _ := os.ReadDir(tn.layout); len(entries) != 0 {
		t.Fatalf("a refused request wrote %v", entries)
	}
	// Likewise a restore into tenant-a's VM, and one from a registry this
	// agent does not allow (refused before the VM is looked up).
	for _, tc := range []struct {
		c     Caller
		image string
		msg   string
	}{
		{callerB, "oci:" + tn.layout + "/tenant-b/x@sha256:" + strings.Repeat("ab", 32), "own namespace tenant-b"},
		{callerA, "reg.example/vms/x@sha256:" + strings.Repeat("ab", 32), "no --allow-repository"},
	} {
		code, b := tn.do(tc.c, "POST", "/v1/restores", `{"vm":{"podUID":"`+uidA+`","container":"qemu","qmp":"/run/vm/qmp.sock"},"image":"`+tc.image+`"}`)
		if code != http.StatusForbidden || !bytes.Contains(b, []byte(`"FORBIDDEN"`)) || !bytes.Contains(b, []byte(tc.msg)) {
			t.Fatalf("%s restoring %s into tenant-a's VM: %d %s", tc.c.Namespace, tc.image, code, b)
		}
	}
	if cmds := tn.vmA.Commands(); len(cmds) != 0 {
		t.Fatalf("tenant-a's VM received %v from refused restores", cmds)
	}
	// Each tenant on its own VM, and the platform's controller on either.
	opA, e := tn.checkpoint(t, callerA, uidA)
	if e.Code != "" || opA.Target.Namespace != "tenant-a" {
		t.Fatalf("tenant-a on its own VM: %+v %+v", e, opA)
	}
	opB, e := tn.checkpoint(t, callerB, uidB)
	if e.Code != "" {
		t.Fatalf("tenant-b on its own VM: %+v", e)
	}
	if code, b := tn.do(callerAdmin, "GET", "/v1/operations", ""); code != 200 || !bytes.Contains(b, []byte(opA.ID)) || !bytes.Contains(b, []byte(opB.ID)) {
		t.Fatalf("the admin's list: %d %s", code, b)
	}

	// Listing: each tenant sees its own operations only.
	for _, tc := range []struct {
		c         Caller
		mine, not string
	}{{callerA, opA.ID, opB.ID}, {callerB, opB.ID, opA.ID}} {
		code, b := tn.do(tc.c, "GET", "/v1/operations", "")
		if code != 200 || !bytes.Contains(b, []byte(tc.mine)) || bytes.Contains(b, []byte(tc.not)) {
			t.Errorf("%s lists %s", tc.c.Namespace, b)
		}
		// Another namespace's operation is answered as one that does not exist.
		_, absent := tn.do(tc.c, "GET", "/v1/operations/0123456789abcdef", "")
		for _, m := range []string{"GET", "DELETE"} {
			code, b := tn.do(tc.c, m, "/v1/operations/"+tc.not, "")
			if code != http.StatusBadRequest || !bytes.Equal(bytes.ReplaceAll(b, []byte(tc.not), []byte("0123456789abcdef")), absent) {
				t.Errorf("%s %s of another namespace's operation: %d %s, want what an unknown one gets: %s", tc.c.Namespace, m, code, b, absent)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		req := httptest.NewRequest("GET", "/v1/events", nil).WithContext(withCaller(ctx, tc.c))
		rec := httptest.NewRecorder()
		tn.h.ServeHTTP(rec, req)
		cancel()
		if ev := rec.Body.String(); !strings.Contains(ev, tc.mine) || strings.Contains(ev, tc.not) {
			t.Errorf("%s's event stream: %s", tc.c.Namespace, ev)
		}
	}
	// tenant-b's cancel did not touch tenant-a's operation; its own does.
	if o, _ := tn.s.ops.get(opA.ID); o.ctx.Err() != nil {
		t.Fatal("tenant-b cancelled tenant-a's operation")
	}
	if code, _ := tn.do(callerA, "DELETE", "/v1/operations/"+opA.ID, ""); code != http.StatusAccepted {
		t.Fatalf("tenant-a cancelling its own operation: %d", code)
	}
	if o, _ := tn.s.ops.get(opA.ID); o.ctx.Err() == nil {
		t.Fatal("tenant-a's cancel did not cancel its operation")
	}
}

// A request without an established caller (no peer credentials) is
// refused, whatever it asks.
func TestRequestWithoutCallerIsForbidden(t *testing.T) {
	tn := newTenants(t)
	for _, r := range []struct{ method, path string }{{"GET", "/v1/operations"}, {"POST", "/v1/checkpoints"}, {"GET", "/v1/events"}, {"DELETE", "/v1/operations/x"}} {
		rec := httptest.NewRecorder()
		tn.h.ServeHTTP(rec, httptest.NewRequest(r.method, r.path, strings.NewReader("{}")))
		var doc api.ErrorDoc
		if err := json.Unmarshal(rec.Body.Bytes(), &doc); err != nil || rec.Code != http.StatusForbidden || doc.Error.Code != errcode.Forbidden {
			t.Errorf("%s %s without a caller: %d %s", r.method, r.path, rec.Code, rec.Body)
		}
	}
	if rec := httptest.NewRecorder(); func() int { tn.h.ServeHTTP(rec, httptest.NewRequest("GET", "/healthz", nil)); return rec.Code }() != 200 {
		t.Error("/healthz needs no caller")
	}
}

// The pid the kernel recorded now belongs to a live process that started
// before the connection was accepted, but the process that connected has
// exited: its pidfd says so, and the caller is refused.
func TestIdentifyRefusesAnExitedConnector(t *testing.T) {
	s := fuzzServer(t)
	child := exec.Command("true")
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	exited, err := unix.PidfdOpen(child.Process.Pid, 0)
	if err != nil {
		t.Skipf("SKIPPING: no pidfd_open on this kernel: %v", err)
	}
	_ = child.Wait()
	gone := &callerConn{peer: peer{pid: int32(os.Getpid())}, accepted: time.Now(), pidfd: exited}
	defer unix.Close(exited)
	if c, err := gone.identify(context.Background(), s); errcode.Of(err) != errcode.Forbidden || !strings.Contains(err.Error(), "exited") {
		t.Fatalf("a connector that exited, its pid taken by a live process: %+v, %v; want FORBIDDEN", c, err)
	}

	// A real connection from this process: a pidfd where the kernel has
	// SO_PEERPIDFD, and a caller on the node.
	dir, err := os.MkdirTemp("", "vmsnap-caller-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ln, err := net.Listen("unix", filepath.Join(dir, "s"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	checked, err := withPeerCheck(ln, "", s.log, newRefusals(s.log))
	if err != nil {
		t.Fatal(err)
	}
	client, err := net.Dial("unix", filepath.Join(dir, "s"))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	conn, err := checked.Accept()
	if err != nil {
		t.Fatal(err)
	}
	cc := conn.(*callerConn)
	t.Logf("pidfd %d (%v)", cc.pidfd, cc.pidfdErr)
	if c, err := cc.identify(context.Background(), s); err != nil || !c.Admin || c.PID != int32(os.Getpid()) {
		t.Fatalf("this process over a real socket: %+v, %v; want an admin", c, err)
	}
	conn.Close()
	if cc.pidfd != -1 {
		t.Fatal("closing the connection left its pidfd open")
	}
}
