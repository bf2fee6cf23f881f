// Package qmptest is a fake QEMU monitor for tests: a unix socket speaking
// the QMP wire protocol (greeting, capabilities negotiation, id echo,
// SCM_RIGHTS descriptors, asynchronous events) whose commands are answered by
// a Handler the test supplies.
//
// A fake QEMU that supports migration to a passed descriptor looks like:
//
//	fds := map[string]*os.File{}
//	srv := qmptest.NewServer(t, func(srv *qmptest.Server, cmd qmptest.Command, files []*os.File) (any, *qmp.Error) {
//		switch cmd.Execute {
//		case "getfd": // remember files[0] under the given fdname
//		case "migrate": // write the state into fds[name], close it, then
//			srv.Emit(goqmp.Event{Event: "MIGRATION", Data: map[string]any{"status": "completed"}})
//		}
//		...
//	})
package qmptest

import (
	"bytes"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	goqmp "github.com/digitalocean/go-qemu/qmp"

	"github.com/vmsnap/vmsnap/qmp"
)

// Command is a command as the fake QEMU received it.
type Command struct {
	Execute   string          `json:"execute"`
	Arguments json.RawMessage `json:"arguments,omitempty"`
	ID        json.RawMessage `json:"id,omitempty"`
}

// Args decodes the command's arguments into v (an absent member decodes as {}).
func (c Command) Args(v any) error {
	if len(c.Arguments) == 0 {
		return json.Unmarshal([]byte("{}"), v)
	}
	return json.Unmarshal(c.Arguments, v)
}

// Handler answers one command for srv (through which it can emit events or
// misbehave). files are the descriptors that arrived with it; the handler may keep them (as getfd does) and may close them, and the
// server closes any left open when it stops. A nil result is sent as {} (as
// QEMU does for commands without a return value); a non-nil err is sent as
// QMP error of that class and description. A json.RawMessage result is sent
// as it is, unchecked. Events the handler emits are sent
// before its reply. Handlers must return eventually: the server waits for
// them when it stops.
type Handler func(srv *Server, cmd Command, files []*os.File) (result any, err *qmp.Error)

// Option configures a Server.
type Option func(*Server)

// WithVersion sets the QEMU version announced in the greeting (7.2.0 by default).
func WithVersion(major, minor, micro int) Option {
	return func(s *Server) {
		s.version.QEMU.Major, s.version.QEMU.Minor, s.version.QEMU.Micro = major, minor, micro
	}
}

// WithConcurrentHandlers runs each command's handler in its own goroutine,
// so replies may leave in a different order than commands arrived. Real
// QEMU answers in order; this exists to prove a client matches replies by id.
func WithConcurrentHandlers() Option {
	return func(s *Server) { s.concurrent = true }
}

// Server is a fake QEMU monitor. It accepts any number of connections.
type Server struct {
	t          testing.TB
	path       string
	ln         *net.UnixListener
	handler    Handler
	version    goqmp.Version
	concurrent bool

	wg sync.WaitGroup // accept loop, connections, concurrent handlers

	mu       sync.Mutex
	conns    map[*conn]struct{}
	files    []*os.File
	received []Command
	closed   bool
}

type conn struct {
	c          *net.UnixConn
	wmu        sync.Mutex // one message at a time
	negotiated atomic.Bool
}

// NewServer starts a fake QEMU monitor on a unix socket in a temporary
// directory. It stops when the test ends.
func NewServer(t testing.TB, h Handler, opts ...Option) *Server {
	t.Helper()
	path := filepath.Join(t.TempDir(), "qmp.sock")
	if len(path) > 100 { // sun_path holds 108 bytes; a long TMPDIR or test name can exceed it
		dir, err := os.MkdirTemp("", "qmp")
		if err != nil {
			t.Fatalf("qmptest: %v", err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		path = filepath.Join(dir, "qmp.sock")
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatalf("qmptest: %v", err)
	}
	s := &Server{t: t, path: path, ln: ln, handler: h, conns: make(map[*conn]struct{})}
	s.version.QEMU.Major, s.version.QEMU.Minor = 7, 2
	s.version.Package = "qmptest"
	for _, o := range opts {
		o(s)
	}
	s.wg.Add(1)
	go s.accept()
	t.Cleanup(s.Close)
	return s
}

// Path is the socket's path, for qmp.Dial.
func (s *Server) Path() string { return s.path }

// Received lists the commands received so far, qmp_capabilities included.
func (s *Server) Received() []Command {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Command(nil), s.received...)
}

// Emit sends an event to every connection that has negotiated capabilities
// (QEMU sends none before). A zero timestamp is set to the current time.
func (s *Server) Emit(ev goqmp.Event) {
	if ev.Timestamp.Seconds == 0 && ev.Timestamp.Microseconds == 0 {
		now := time.Now()
		ev.Timestamp.Seconds, ev.Timestamp.Microseconds = now.Unix(), int64(now.Nanosecond()/1000)
	}
	msg := map[string]any{"event": ev.Event, "timestamp": ev.Timestamp}
	if ev.Data != nil { // QEMU omits data for events that have none
		msg["data"] = ev.Data
	}
	b := s.encode(msg)
	for _, cn := range s.liveConns() {
		if cn.negotiated.Load() {
			cn.write(b)
		}
	}
}

// WriteRaw writes b as it is to every connection, to feed clients partial or
// malformed messages.
func (s *Server) WriteRaw(b []byte) {
	for _, cn := range s.liveConns() {
		cn.write(b)
	}
}

// CloseConnections drops every current connection, as a dying QEMU would;
// the server keeps accepting new ones.
func (s *Server) CloseConnections() {
	for _, cn := range s.liveConns() {
		cn.c.Close()
	}
}

// Close stops the server, drops its connections, waits for its goroutines
// and closes the descriptors it received. It is called when the test ends.
func (s *Server) Close() {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	s.mu.Unlock()
	s.ln.Close()
	s.CloseConnections()
	s.wg.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, f := range s.files {
		f.Close()
	}
	s.files = nil
}

func (s *Server) liveConns() []*conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	cs := make([]*conn, 0, len(s.conns))
	for cn := range s.conns {
		cs = append(cs, cn)
	}
	return cs
}

func (s *Server) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			return
		}
		cn := &conn{c: c}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			return
		}
		s.conns[cn] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.serve(cn)
	}
}

func (s *Server) serve(cn *conn) {
	defer s.wg.Done()
	defer func() {
		cn.c.Close()
		s.mu.Lock()
		delete(s.conns, cn)
		s.mu.Unlock()
	}()

	cn.write(s.encode(map[string]any{"QMP": map[string]any{
		"version": s.version, "capabilities": []string{"oob"},
	}}))

	buf := make([]byte, 64<<10)
	oob := make([]byte, syscall.CmsgSpace(64*4))
	var pendingLine []byte      // bytes of the command not yet terminated
	var pendingFiles []*os.File // descriptors that arrived with pendingLine
	for {
		n, oobn, _, _, err := cn.c.ReadMsgUnix(buf, oob)
		n, oobn = max(n, 0), max(oobn, 0) // a failed read may report -1
		if n > 0 {
			acquireWrites(cn.c)
		}
		files := s.receiveFiles(oob[:oobn])
		pendingLine = append(pendingLine, buf[:n]...)
		var lines [][]byte
		for {
			i := bytes.IndexByte(pendingLine, '\n')
			if i < 0 {
				break
			}
			lines = append(lines, append([]byte(nil), pendingLine[:i+1]...))
			pendingLine = pendingLine[i+1:]
		}
		// The kernel ends a read at the end of the message that carried
		// descriptors, so they belong to the command containing the last
		// byte read: the last complete line if the read ended with a
		// newline, else the line still in progress.
		endsLine := n > 0 && buf[n-1] == '\n'
		for i, line := range lines {
			var fs []*os.File
			if i == 0 {
				fs, pendingFiles = pendingFiles, nil
			}
			if i == len(lines)-1 && endsLine {
				fs, files = append(fs, files...), nil
			}
			s.handle(cn, line, fs)
		}
		pendingFiles = append(pendingFiles, files...)
		if err != nil {
			return
		}
	}
}

// acquireWrites tells the race detector that what the client did before
// writing the bytes just read happened before what the handler does next, as
// it does with a real QEMU in another process. The detector models that for
// read(2) and write(2), but not for the recvmsg(2) the server must use to
// receive descriptors; a zero-length read(2), which returns at once, supplies
// the edge. Commands the client sends with sendmsg(2) (ExecuteWithFile) still
// carry no edge: guard state shared by a test and its handler with a mutex.
func acquireWrites(c *net.UnixConn) {
	if rc, err := c.SyscallConn(); err == nil {
		rc.Control(func(fd uintptr) { syscall.Read(int(fd), nil) })
	}
}

func (s *Server) receiveFiles(oob []byte) []*os.File {
	if len(oob) == 0 {
		return nil
	}
	msgs, err := syscall.ParseSocketControlMessage(oob)
	if err != nil {
		s.t.Errorf("qmptest: parsing control message: %v", err)
		return nil
	}
	var files []*os.File
	for _, m := range msgs {
		fds, err := syscall.ParseUnixRights(&m)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			files = append(files, os.NewFile(uintptr(fd), "qmptest-received-fd"))
		}
	}
	s.mu.Lock()
	s.files = append(s.files, files...)
	s.mu.Unlock()
	return files
}

func (s *Server) handle(cn *conn, line []byte, files []*os.File) {
	if len(bytes.TrimSpace(line)) == 0 {
		return
	}
	var cmd Command
	if err := json.Unmarshal(line, &cmd); err != nil || cmd.Execute == "" {
		// Like QEMU: the error cannot carry an id it could not parse.
		s.reply(cn, nil, nil, &qmp.Error{Class: "GenericError", Desc: "JSON parse error or missing 'execute'"})
		return
	}
	s.mu.Lock()
	s.received = append(s.received, cmd)
	s.mu.Unlock()

	if cmd.Execute == "qmp_capabilities" {
		if cn.negotiated.Swap(true) {
			s.reply(cn, cmd.ID, nil, &qmp.Error{Class: "CommandNotFound", Desc: "Capabilities negotiation is already complete, command ignored"})
			return
		}
		s.reply(cn, cmd.ID, nil, nil)
		return
	}
	if !cn.negotiated.Load() {
		s.reply(cn, cmd.ID, nil, &qmp.Error{Class: "CommandNotFound", Desc: "Expecting capabilities negotiation with 'qmp_capabilities'"})
		return
	}
	run := func() {
		if s.handler == nil {
			s.reply(cn, cmd.ID, nil, &qmp.Error{Class: "CommandNotFound", Desc: "The command " + cmd.Execute + " has not been found"})
			return
		}
		result, qerr := s.handler(s, cmd, files)
		s.reply(cn, cmd.ID, result, qerr)
	}
	if s.concurrent {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			run()
		}()
		return
	}
	run()
}

func (s *Server) reply(cn *conn, id json.RawMessage, result any, qerr *qmp.Error) {
	if raw, ok := result.(json.RawMessage); ok && qerr == nil {
		// Spliced rather than re-encoded, so that multi-megabyte test
		// replies cost no more than their bytes.
		b := append([]byte(`{"return": `), raw...)
		if len(id) > 0 {
			b = append(append(b, `, "id": `...), id...)
		}
		cn.write(append(b, "}\r\n"...))
		return
	}
	msg := map[string]any{}
	if len(id) > 0 {
		msg["id"] = id
	}
	if qerr != nil {
		msg["error"] = map[string]string{"class": qerr.Class, "desc": qerr.Desc}
	} else {
		if result == nil {
			result = struct{}{}
		}
		msg["return"] = result
	}
	cn.write(s.encode(msg))
}

func (s *Server) encode(msg any) []byte {
	b, err := json.Marshal(msg)
	if err != nil {
		s.t.Errorf("qmptest: encoding %T: %v", msg, err)
		b = []byte(`{"error":{"class":"GenericError","desc":"qmptest: unencodable reply"}}`)
	}
	return append(b, '\r', '\n') // QEMU ends lines with CRLF
}

// write sends one whole message; errors mean the client has gone, which
// is the client's business.
func (cn *conn) write(b []byte) {
	cn.wmu.Lock()
	defer cn.wmu.Unlock()
	cn.c.Write(b)
}
