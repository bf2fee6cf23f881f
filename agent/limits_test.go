//go:build linux

package agent

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

const silentChildConns = "VMSNAP_SILENT_CONNS"

// TestSilentChild is not a test: the attacker of
// TestAgentSilentConnectionsFromOneCaller, in a child process. It opens
// connections to the agent, sends nothing on them, says how many it
// opened, and holds them until its stdin closes.
func TestSilentChild(t *testing.T) {
	socket := os.Getenv(floodChildSocket)
	if socket == "" || os.Getenv(silentChildConns) == "" {
		t.Skip("helper process of TestAgentSilentConnectionsFromOneCaller: runs only as its child")
	}
	var n int
	fmt.Sscan(os.Getenv(silentChildConns), &n)
	var held []net.Conn
	for range n {
		if c, err := net.Dial("unix", socket); err == nil {
			held = append(held, c)
		}
	}
	fmt.Printf("%s{\"streams\":%d}\n", floodResultMark, len(held))
	_, _ = io.Copy(io.Discard, os.Stdin)
	for _, c := range held {
		c.Close()
	}
}

// A caller that opens 2,000 connections and sends nothing on them holds
// at most its connection limit: the rest are refused as they come, before
// the HTTP server sees them. Meanwhile another caller is served.
func TestAgentSilentConnectionsFromOneCaller(t *testing.T) {
	placeOthersIn(t, "tenant-a")
	a := startAgentConfig(t, Config{StateDir: t.TempDir(), Resolver: newStaticResolver(), Limits: Limits{Connections: 8}})
	const attacker = "namespace tenant-a"
	child := exec.Command(os.Args[0], "-test.run=^TestSilentChild$")
	child.Env = append(os.Environ(), floodChildSocket+"="+a.socket, silentChildConns+"=2000")
	stdin, _ := child.StdinPipe()
	stdout, _ := child.StdoutPipe()
	child.Stderr = os.Stderr
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	defer child.Process.Kill()
	r, _ := floodOutcome(stdout)
	opened := r.Streams
	// The agent admits what the limit allows as it accepts the backlog.
	deadline := time.Now().Add(30 * time.Second)
	for a.srv.held.count(attacker, connections) < 8 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	held := a.srv.held.count(attacker, connections)
	// Until the server's header timeout (10 s) closes them, the admitted
	// ones stay: it is the caller's to hold what its limit allows.
	if _, err := a.client.List(context.Background()); err != nil {
		t.Fatalf("another caller, while tenant-a holds its connections: %v", err)
	}
	t.Logf("the attacker opened %d connections; the agent holds %d of them", opened, held)
	if held != 8 || opened < 1000 {
		t.Fatalf("the agent holds %d of the attacker's %d silent connections; want its limit, 8, at most", held, opened)
	}
	stdin.Close()
	_ = child.Wait()
}

// A request head over 16 KiB is refused (431) and the connection closed:
// a caller cannot make the agent hold a megabyte per connection. Heads of
// a real client's size pass.
func TestAgentRefusesHugeRequestHeads(t *testing.T) {
	a := startAgentConfig(t, Config{StateDir: t.TempDir(), Resolver: newStaticResolver()})
	for _, tc := range []struct {
		header int
		status int
	}{{1 << 20, http.StatusRequestHeaderFieldsTooLarge}, {64 << 10, http.StatusRequestHeaderFieldsTooLarge}, {8 << 10, http.StatusOK}} {
		c, err := net.Dial("unix", a.socket)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		go func() {
			_, _ = fmt.Fprintf(c, "GET /v1/operations HTTP/1.1\r\nHost: agent\r\nX-Pad: %s\r\n\r\n", strings.Repeat("p", tc.header))
		}()
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		c.Close()
		if err != nil || resp.StatusCode != tc.status {
			t.Fatalf("a %d-byte header: %v %v, want %d", tc.header, resp, err, tc.status)
		}
	}
}

// A caller with many VMs holds at most its operations limit, pending or
// running; beyond it BUSY, naming the flag. Another caller starts its own;
// an operation that ends gives its place back.
func TestAgentOperationsPerCallerBounded(t *testing.T) {
	const limit = 4
	res := newStaticResolver()
	var vms []string
	for i := range limit + 2 {
		uid := podUID(i)
		res.vms[uid] = api.Target{PodUID: uid, Container: "qemu", ContainerID: "c-" + uid, QMPPath: qmptest.NewFakeQEMU(t, "running", nil).Path(), Namespace: "tenant-a"}
		vms = append(vms, uid)
	}
	res.vms[uidB] = api.Target{PodUID: uidB, Container: "qemu", ContainerID: "c-b", QMPPath: qmptest.NewFakeQEMU(t, "running", nil).Path(), Namespace: "tenant-b"}
	root := t.TempDir()
	s, err := New(context.Background(), Config{StateDir: t.TempDir(), Resolver: res, LayoutRoot: root, MaxConcurrent: 1, Limits: Limits{Operations: limit},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	s.slots <- struct{}{} // operations stay pending: nothing reaches a VM by itself
	tn := &tenants{s: s, h: s.Handler(), layout: root}
	var ids []string
	for i, uid := range vms {
		resolved := res.calls
		o, e := tn.checkpoint(t, callerA, uid)
		switch {
		case i < limit && e.Code != "":
			t.Fatalf("tenant-a's operation %d: %+v", i, e)
		case i < limit:
			ids = append(ids, o.ID)
		case e.Code != errcode.Busy || !strings.Contains(e.Message, "--max-operations-per-caller"):
			t.Fatalf("tenant-a's operation %d, over its limit: %+v, want BUSY naming the flag", i, e)
		case res.calls != resolved:
			t.Fatalf("a request over the limit was resolved: it should cost the agent nothing but the refusal")
		}
	}
	if _, e := tn.checkpoint(t, callerB, uidB); e.Code != "" {
		t.Fatalf("tenant-b, while tenant-a holds its limit: %+v", e)
	}
	if code, _ := tn.do(callerA, "DELETE", "/v1/operations/"+ids[0], ""); code != http.StatusAccepted {
		t.Fatalf("cancelling: %d", code)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, e := tn.checkpoint(t, callerA, vms[limit]); e.Code == "" {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("tenant-a's operation after one of its own ended: %+v", e)
		}
		time.Sleep(10 * time.Millisecond)
	}
	<-s.slots
	s.ops.cancelAll(errcode.New(errcode.Internal, "the test ends"))
	s.ops.wait(context.Background())
}

// A tenant that creates and deletes pods with operations makes the agent
// remember why each was forgotten: the newest removedLimit, no more.
func TestForgottenOperationsBounded(t *testing.T) {
	tab := newTable()
	var last *op
	for i := range 5 * 1024 {
		o := newOp(api.KindCheckpoint, api.VMRef{PodUID: podUID(i % 10000), Container: "qemu"}, &api.Target{Namespace: "tenant-a"}, time.Hour)
		o.cancel(nil)
		tab.addFinished(&o.data)
		tab.remove(o, errcode.New(errcode.VMNotFound, "pod %d deleted", i))
		last = o
	}
	if len(tab.removed) != removedLimit || len(tab.gone) != removedLimit {
		t.Fatalf("%d reasons kept (%d ids), want %d", len(tab.removed), len(tab.gone), removedLimit)
	}
	if _, err := tab.get(last.id); errcode.Of(err) != errcode.VMNotFound {
		t.Fatalf("the newest forgotten operation: %v, want its reason", err)
	}
}

// A caller that opens an event stream and stops reading it does not hold
// the stream, and its goroutine, for good: once a write has waited
// streamWriteTimeout, the agent ends the stream and closes the connection.
func TestAgentEndsAStreamItsCallerDoesNotRead(t *testing.T) {
	old := streamWriteTimeout
	streamWriteTimeout = 200 * time.Millisecond
	t.Cleanup(func() { streamWriteTimeout = old })
	a := startAgentConfig(t, Config{StateDir: t.TempDir(), Resolver: newStaticResolver()})
	c, err := net.Dial("unix", a.socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "GET /v1/events HTTP/1.1\r\nHost: agent\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	if resp, err := http.ReadResponse(br, nil); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("the stream: %v %v", resp, err)
	}
	who := holderOf(Caller{Admin: true})
	// Events the caller does not read, more than the socket buffers.
	big := api.Operation{ID: "x", Kind: api.KindCheckpoint, State: api.StateRunning, Error: &api.Error{Message: strings.Repeat("e", 32<<10)}}
	for range 256 {
		a.srv.events.publish(big)
	}
	deadline := time.Now().Add(30 * time.Second)
	for a.srv.held.count(who, streams) > 0 {
		if time.Now().After(deadline) {
			t.Fatal("the agent still holds the stream nobody reads")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// ... and closed the connection: what it had sent, then the end.
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.Copy(io.Discard, br); err != nil {
		t.Fatalf("the agent did not close the connection of the stream it ended: %v", err)
	}
}
