package qmptest_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"testing"
	"time"

	goqmp "github.com/digitalocean/go-qemu/qmp"

	"github.com/vmsnap/vmsnap/qmp"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

type rawConn struct {
	t *testing.T
	c net.Conn
	r *bufio.Reader
}

func rawDial(t *testing.T, srv *qmptest.Server) *rawConn {
	c, err := net.Dial("unix", srv.Path())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &rawConn{t: t, c: c, r: bufio.NewReader(c)}
}

func (rc *rawConn) send(line string) {
	if _, err := rc.c.Write([]byte(line + "\n")); err != nil {
		rc.t.Fatal(err)
	}
}

func (rc *rawConn) recv() map[string]json.RawMessage {
	rc.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	line, err := rc.r.ReadBytes('\n')
	if err != nil {
		rc.t.Fatalf("reading from the fake: %v", err)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(line, &m); err != nil {
		rc.t.Fatalf("fake sent %q: %v", line, err)
	}
	return m
}

func errorClass(m map[string]json.RawMessage) string {
	var e struct{ Class string }
	json.Unmarshal(m["error"], &e)
	return e.Class
}

// The exchanges below are the ones QEMU 7.2 was observed to produce.
func TestServerSpeaksQMPLikeQEMU(t *testing.T) {
	srv := qmptest.NewServer(t, nil, qmptest.WithVersion(9, 0, 1))
	rc := rawDial(t, srv)

	var g struct {
		QMP struct {
			Version      goqmp.Version
			Capabilities []string
		}
	}
	if err := json.Unmarshal(mustJSON(t, rc.recv()), &g); err != nil || g.QMP.Version.QEMU.Major != 9 || g.QMP.Version.QEMU.Micro != 1 {
		t.Fatalf("greeting %+v, %v", g, err)
	}

	rc.send(`{"execute":"query-status","id":"early"}`)
	if m := rc.recv(); errorClass(m) != "CommandNotFound" || string(m["id"]) != `"early"` {
		t.Errorf("command before negotiation: %s", mustJSON(t, m))
	}
	rc.send(`{"execute":"qmp_capabilities","id":{"any":["json"]}}`)
	if m := rc.recv(); string(m["return"]) != "{}" || string(m["id"]) != `{"any":["json"]}` {
		t.Errorf("qmp_capabilities: %s", mustJSON(t, m))
	}
	rc.send(`{"execute":"qmp_capabilities","id":2}`)
	if m := rc.recv(); errorClass(m) != "CommandNotFound" {
		t.Errorf("second qmp_capabilities: %s", mustJSON(t, m))
	}
	rc.send(`garbage`)
	if m := rc.recv(); errorClass(m) != "GenericError" || m["id"] != nil {
		t.Errorf("unparseable input: %s", mustJSON(t, m))
	}
	rc.send(`{"execute":"query-status","id":3}`)
	if m := rc.recv(); errorClass(m) != "CommandNotFound" || string(m["id"]) != "3" {
		t.Errorf("command without a handler: %s", mustJSON(t, m))
	}

	// Events go to negotiated connections only.
	quiet := rawDial(t, srv)
	quiet.recv() // greeting
	srv.Emit(goqmp.Event{Event: "RESUME"})
	if m := rc.recv(); string(m["event"]) != `"RESUME"` || m["timestamp"] == nil || m["data"] != nil {
		t.Errorf("event: %s", mustJSON(t, m))
	}
	quiet.c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if line, err := quiet.r.ReadBytes('\n'); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("connection that never negotiated received %q (%v)", line, err)
	}

	if got := srv.Received(); len(got) != 4 || got[1].Execute != "qmp_capabilities" {
		t.Errorf("Received() = %+v", got)
	}
}

func mustJSON(t *testing.T, v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Under -race this fails unless the server tells the detector that a command
// is handled after everything its sender did before sending it.
func TestHandlerSeesStateSetBeforeTheCommand(t *testing.T) {
	var answer string
	srv := qmptest.NewServer(t, func(*qmptest.Server, qmptest.Command, []*os.File) (any, *qmp.Error) {
		return answer, nil
	})
	answer = "set after NewServer, without a lock"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := qmp.Dial(ctx, srv.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var got string
	if err := c.Execute(ctx, "answer", nil, &got); err != nil || got != answer {
		t.Fatalf("got %q, %v", got, err)
	}
}
