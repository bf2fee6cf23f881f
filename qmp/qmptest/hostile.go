package qmptest

import (
	"bytes"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// Misbehaviour is how a Hostile peer breaks the QMP protocol.
type Misbehaviour int

const (
	// NeverGreets accepts connections and says nothing, as QEMU does to a
	// second client while another one holds its monitor.
	NeverGreets Misbehaviour = iota
	// GreetsThenSilent greets and then never answers a command.
	GreetsThenSilent
	// HugeLine greets and answers the first command with one line of
	// HugeLineBytes bytes (a JSON reply whose string never ends soon),
	// written in pieces, never held whole.
	HugeLine
)

// HugeLineBytes is the length of HugeLine's line: 512 MiB.
const HugeLineBytes = 512 << 20

// Hostile is a peer on a QMP socket that misbehaves in one way, for tests
// of what a QEMU under someone else's control can make vmsnap do.
type Hostile struct {
	path    string
	ln      net.Listener
	wg      sync.WaitGroup
	mu      sync.Mutex
	conns   []net.Conn
	written int64 // bytes of HugeLine's line written
}

// NewHostile starts a hostile peer on qmp.sock in a directory of its own
// (a container's volume can be that directory). It stops at the end of the
// test.
func NewHostile(t testing.TB, how Misbehaviour) *Hostile {
	t.Helper()
	dir, err := os.MkdirTemp("", "qmp-hostile-") // short: a socket path holds 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	h := &Hostile{path: filepath.Join(dir, "qmp.sock")}
	if h.ln, err = net.Listen("unix", h.path); err != nil {
		t.Fatal(err)
	}
	h.wg.Add(1)
	go h.accept(how)
	t.Cleanup(func() {
		h.ln.Close()
		h.mu.Lock()
		for _, c := range h.conns {
			c.Close()
		}
		h.mu.Unlock()
		h.wg.Wait()
		os.RemoveAll(dir)
	})
	return h
}

// Path is the socket's path.
func (h *Hostile) Path() string { return h.path }

// HugeLineWritten is how many bytes of HugeLine's line the peer managed to
// write before the client hung up.
func (h *Hostile) HugeLineWritten() int64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.written
}

func (h *Hostile) accept(how Misbehaviour) {
	defer h.wg.Done()
	for {
		c, err := h.ln.Accept()
		if err != nil {
			return
		}
		h.mu.Lock()
		h.conns = append(h.conns, c)
		h.mu.Unlock()
		h.wg.Add(1)
		go func() {
			defer h.wg.Done()
			h.serve(c, how)
		}()
	}
}

const hostileGreeting = `{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": "hostile"}, "capabilities": []}}` + "\r\n"

func (h *Hostile) serve(c net.Conn, how Misbehaviour) {
	if how == NeverGreets {
		_, _ = io.Copy(io.Discard, c) // hold the connection until the client leaves
		return
	}
	if _, err := io.WriteString(c, hostileGreeting); err != nil {
		return
	}
	if how == GreetsThenSilent {
		_, _ = io.Copy(io.Discard, c)
		return
	}
	// Wait for the first command, then answer with the huge line.
	if _, err := c.Read(make([]byte, 4096)); err != nil {
		return
	}
	h.wg.Add(1)
	go func() { defer h.wg.Done(); _, _ = io.Copy(io.Discard, c) }()
	piece := bytes.Repeat([]byte("a"), 1<<20)
	n, _ := io.WriteString(c, `{"return": {"blob": "`)
	h.add(int64(n))
	for written := int64(n); written < HugeLineBytes-64; written += int64(len(piece)) {
		n, err := c.Write(piece)
		h.add(int64(n))
		if err != nil {
			return
		}
	}
	n, _ = io.WriteString(c, `"}, "id": 1}`+"\n")
	h.add(int64(n))
}

func (h *Hostile) add(n int64) {
	h.mu.Lock()
	h.written += n
	h.mu.Unlock()
}
