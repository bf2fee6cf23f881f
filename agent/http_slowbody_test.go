package agent

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// A caller that announces a body and never sends it is answered (and its
// connection let go) once bodyTimeout passes; it does not hold the
// connection and its goroutine for good.
func TestAgentDropsACallerThatNeverSendsItsBody(t *testing.T) {
	old := bodyTimeout
	bodyTimeout = 300 * time.Millisecond
	t.Cleanup(func() { bodyTimeout = old })
	a := startAgent(t, t.TempDir(), newStaticResolver(), 1)

	conn, err := net.Dial("unix", a.socket)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := io.WriteString(conn, "POST /v1/checkpoints HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"vm\":"); err != nil {
		t.Fatal(err)
	}
	// Nothing more is sent. Without the body's deadline this read would
	// wait for good; 10 s is far beyond the 300 ms allowed.
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	start := time.Now()
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer to a body that never came after %v: %v", time.Since(start), err)
	}
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), `"INVALID_INPUT"`) {
		t.Fatalf("a body that never came: %s %s, want 400 INVALID_INPUT", resp.Status, body)
	}
	// And the connection is closed, not kept for another request.
	if n, err := conn.Read(make([]byte, 1)); err == nil {
		t.Fatalf("the connection stayed open (read %d bytes)", n)
	}
}
