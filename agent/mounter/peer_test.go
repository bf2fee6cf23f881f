package mounter

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// childEnv makes the test binary a client that asks the mounter at the
// socket it names for the FUSE descriptor and prints the error code.
const childEnv = "VMSNAP_MOUNTER_TEST_CLIENT"

func TestMain(m *testing.M) {
	if sock := os.Getenv(childEnv); sock != "" {
		_, err := Client{Socket: sock}.GetFUSE(context.Background())
		fmt.Print(errcode.Of(err))
		if err == nil {
			fmt.Print("OK")
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestRefusesACallerThatIsNotRoot: with the socket's directory loosened
// (a hostPath mounted with the wrong mode), a process of another user
// reaches the socket; the kernel's record of who connected still refuses
// it, and it is told so.
func TestRefusesACallerThatIsNotRoot(t *testing.T) {
	f := newFixture(t)
	sock := f.client.Socket
	for _, p := range []string{f.root, filepath.Dir(f.root), filepath.Dir(sock)} {
		must(t, os.Chmod(p, 0o755))
	}
	must(t, os.Chmod(sock, 0o777))
	self := copyExecutable(t)
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), childEnv+"="+sock)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("the client as uid 65534: %v (can it execute %s?)", err, self)
	}
	if string(out) != string(errcode.Forbidden) {
		t.Fatalf("a client of uid 65534 got %q, want FORBIDDEN", out)
	}
	// Root itself is still served: the refusal is about who, not a broken socket.
	if _, err := f.client.GetFUSE(context.Background()); err != nil {
		t.Fatalf("root's request: %v", err)
	}
}

// copyExecutable copies the test binary where another user may run it
// (go test builds it in a directory of root's alone).
func copyExecutable(t *testing.T) string {
	t.Helper()
	self, err := os.Executable()
	must(t, err)
	dir, err := os.MkdirTemp("", "mounter-client")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	must(t, os.Chmod(dir, 0o755))
	b, err := os.ReadFile(self)
	must(t, err)
	must(t, os.WriteFile(dir+"/client", b, 0o755))
	return dir + "/client"
}

// TestRefusesRootOfAnotherGroup: with the agent's gid configured, a root
// process of another gid is refused too.
func TestRefusesRootOfAnotherGroup(t *testing.T) {
	f := newFixture(t, func(s *setup) { s.cfg.AgentGID = os.Getegid() + 4242 })
	r := f.volume(t, testUID, "ram")
	wantCode(t, "publish by root of another gid", f.client.Publish(context.Background(), r), errcode.Forbidden)
	noMountsIn(t, f.root)
}

// TestRefusesALooseSocketDirectory: the mounter will not listen in a
// directory that others may enter.
func TestRefusesALooseSocketDirectory(t *testing.T) {
	requireRoot(t)
	root := t.TempDir()
	must(t, os.Mkdir(root+"/run", 0o755))
	must(t, os.Mkdir(root+"/pods", 0o755))
	_, err := New(Config{Socket: root + "/run/m.sock", PodsDir: root + "/pods", PublicationRoots: []string{root + "/pub"}, AgentGID: -1})
	wantCode(t, "listening in a 0755 directory", err, errcode.Usage)
}

// rawCall sends one raw message on a fresh connection and returns the
// response (or the error that ended the exchange).
func rawCall(t *testing.T, sock string, msg []byte) (response, error) {
	t.Helper()
	c, err := net.Dial("unixpacket", sock)
	must(t, err)
	defer c.Close()
	if _, err := c.Write(msg); err != nil {
		return response{}, err
	}
	buf := make([]byte, MaxMessage)
	n, err := c.Read(buf)
	if err != nil {
		return response{}, err
	}
	var resp response
	must(t, json.Unmarshal(buf[:n], &resp))
	return resp, nil
}

// TestRefusesMalformedRequests: a message over the bound, another
// protocol version, an unknown operation, and a request for an operation
// without its object are each answered with INVALID_INPUT.
func TestRefusesMalformedRequests(t *testing.T) {
	f := newFixture(t)
	huge := `{"v":1,"op":"publish","publish":{"target":"` + strings.Repeat("a", 64<<10) + `"}}`
	for _, tc := range []struct{ name, msg, want string }{
		{"oversized", huge, "over the protocol's"},
		{"another version", `{"v":2,"op":"get-fuse-fd"}`, "version 2"},
		{"unknown operation", `{"v":1,"op":"mount"}`, "unknown mounter operation"},
		{"publish without its object", `{"v":1,"op":"publish"}`, "without its publish object"},
		{"not JSON", `mount /etc`, "not the protocol's JSON"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := rawCall(t, f.client.Socket, []byte(tc.msg))
			must(t, err)
			if resp.Error == nil || resp.Error.Code != errcode.InvalidInput || !strings.Contains(resp.Error.Message, tc.want) {
				t.Fatalf("answer %+v, want INVALID_INPUT saying %q", resp.Error, tc.want)
			}
		})
	}
	noMountsIn(t, f.root)
}

// TestAnswersALongRefusal: a request under the bound whose refusal quotes
// it, escaped twice over (%q, then JSON), past the bound, still gets its
// answer (cut to fit), not silence.
func TestAnswersALongRefusal(t *testing.T) {
	f := newFixture(t)
	r := f.volume(t, testUID, "ram")
	r.Target = "/" + strings.Repeat(`"`, MaxMessage/2-400)
	wantCode(t, "publish onto a long target", f.client.Publish(context.Background(), r), errcode.Forbidden)
}
