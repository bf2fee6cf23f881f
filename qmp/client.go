package qmp

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	goqmp "github.com/digitalocean/go-qemu/qmp"
	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/beneath"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Client is a QMP connection to one QEMU process. All methods are safe for
// concurrent use.
type Client struct {
	conn    *net.UnixConn
	version goqmp.Version
	caps    []string

	// writeSem serializes writes so that two commands' bytes never
	// interleave; it is a channel rather than a mutex so that waiting for it
	// honours the caller's context.
	writeSem chan struct{}

	mu      sync.Mutex
	nextID  uint64
	pending map[uint64]chan *reply
	subs    map[*Subscription]struct{}
	err     error // why the connection ended; nil while it is up

	done       chan struct{} // closed when err is set
	readerDone chan struct{} // closed when the reader goroutine has returned
}

// reply is a QMP command response as read off the wire.
type reply struct {
	line []byte // the whole response object, for Monitor.Run
	msg  message
}

// message is any message from QEMU: a reply or an event. One type for both
// lets the reader decode each line once.
type message struct {
	Event  string          `json:"event"`
	ID     json.RawMessage `json:"id"`
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`

	Data      json.RawMessage `json:"data"` // decoded only if someone subscribed
	Timestamp struct {
		Seconds      int64 `json:"seconds"`
		Microseconds int64 `json:"microseconds"`
	} `json:"timestamp"`
}

type request struct {
	Execute   string `json:"execute"`
	Arguments any    `json:"arguments,omitempty"`
	ID        uint64 `json:"id"`
}

// MaxLineBytes is the longest message QEMU may send. The largest real one,
// query-qmp-schema's reply, is about 200 KiB; a longer line is a QEMU
// that is broken or hostile (a pod's QEMU is the tenant's), and reading on
// would let it grow our memory without bound. The line is read in pieces and
// the connection ends as soon as the cap is passed, so a line's cost is
// never more than about twice the cap.
const MaxLineBytes = 16 << 20

// greetingTimeout bounds the wait for QEMU's greeting whatever the caller's
// context says: QEMU accepts a second client's connection but greets it
// only once the first one leaves, which may be never. A QEMU that answers
// at all greets at once. (A variable for tests.)
var greetingTimeout = 10 * time.Second

// commandTimeout bounds every command whatever the caller's context says.
// QEMU answers in its main loop; a command that takes this long means that
// loop is stuck, or that the peer is not QEMU. The longest legitimate ones
// (stop, which drains the disks' I/O) take seconds. (A variable for tests.)
var commandTimeout = 5 * time.Minute

type greetingBody struct {
	Version      goqmp.Version `json:"version"`
	Capabilities []string      `json:"capabilities"`
}

// Dial connects to the QMP unix socket at path, reads QEMU's greeting and
// negotiates capabilities. ctx bounds the whole handshake, and the greeting
// is awaited for at most 10 seconds whatever ctx says: QEMU serves one client
// per QMP socket, and a second client's connection is accepted by the
// kernel but never greeted (BUSY).
func Dial(ctx context.Context, path string) (*Client, error) {
	return dial(ctx, path, path)
}

// DialFile is Dial for the QMP socket that f, a descriptor of it (O_PATH
// is enough), is open on: it connects through f's /proc/self/fd link, so
// the socket is the one f was opened on whatever its path names now, and
// its path may be longer than a socket address holds. Messages call it
// name. f must stay open until DialFile returns.
func DialFile(ctx context.Context, f *os.File, name string) (*Client, error) {
	c, err := dial(ctx, beneath.ProcPath(f), name)
	runtime.KeepAlive(f)
	return c, err
}

// dial connects to the socket at addr, which messages call path.
func dial(ctx context.Context, addr, path string) (*Client, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", addr)
	if err != nil {
		return nil, dialError(path, err)
	}
	conn := nc.(*net.UnixConn)

	// The greeting is read here, before the reader goroutine exists, so
	// nothing can race with it.
	br := bufio.NewReaderSize(conn, 64<<10)
	gctx, cancel := context.WithTimeout(ctx, greetingTimeout)
	g, err := readGreeting(gctx, conn, br, path)
	cancel()
	if err != nil {
		conn.Close()
		return nil, err
	}

	c := &Client{
		conn:       conn,
		version:    g.Version,
		caps:       g.Capabilities,
		writeSem:   make(chan struct{}, 1),
		pending:    make(map[uint64]chan *reply),
		subs:       make(map[*Subscription]struct{}),
		done:       make(chan struct{}),
		readerDone: make(chan struct{}),
	}
	go c.readLoop(br)

	// No optional capability (such as oob) is enabled: getfd's SCM_RIGHTS
	// passing works without it, and in-order execution is what we want.
	if err := c.Execute(ctx, "qmp_capabilities", nil, nil); err != nil {
		c.Close()
		return nil, errcode.Wrap(errcode.QMPError, err, "negotiating QMP capabilities on %s", path)
	}
	return c, nil
}

func dialError(path string, err error) error {
	switch {
	case errors.Is(err, syscall.ENOENT), errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ENOTSOCK):
		return errcode.Wrap(errcode.VMNotFound, err,
			"no QEMU is listening at %s: check that the VM is running and was started with -qmp unix:%s,server=on,wait=off", path, path)
	case errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM):
		return errcode.Wrap(errcode.QMPError, err,
			"not allowed to connect to %s: run as a user with write access to the QMP socket", path)
	}
	return errcode.Wrap(errcode.QMPError, err, "connecting to the QMP socket %s", path)
}

func readGreeting(ctx context.Context, conn *net.UnixConn, br *bufio.Reader, path string) (*greetingBody, error) {
	if dl, ok := ctx.Deadline(); ok {
		conn.SetReadDeadline(dl)
	}
	stop := interruptOnDone(ctx, conn.SetReadDeadline)
	line, err := readLine(br)
	stop()
	conn.SetReadDeadline(time.Time{})

	switch {
	case err == nil:
	case errors.Is(ctx.Err(), context.Canceled):
		return nil, errcode.Wrap(errcode.QMPError, ctx.Err(), "waiting for the QMP greeting on %s", path)
	case errors.Is(err, os.ErrDeadlineExceeded):
		return nil, errcode.Wrap(errcode.Busy, context.DeadlineExceeded,
			"QEMU accepted the connection on %s but sent no QMP greeting in time; "+
				"another client probably holds the monitor (QEMU serves one QMP client per socket): try again once it has disconnected", path)
	case errors.Is(err, errLineTooLong):
		return nil, errcode.Wrap(errcode.QMPError, err, "reading the QMP greeting from %s", path)
	case errors.Is(err, io.EOF):
		return nil, errcode.Wrap(errcode.QMPError, err, "QEMU closed %s before sending the QMP greeting", path)
	default:
		return nil, errcode.Wrap(errcode.QMPError, err, "reading the QMP greeting from %s", path)
	}
	var g struct {
		QMP *greetingBody `json:"QMP"`
	}
	if err := json.Unmarshal(line, &g); err != nil || g.QMP == nil {
		return nil, errcode.New(errcode.QMPError,
			"%s did not greet with QMP (got %q): is it a QMP socket rather than an HMP monitor or a serial console?",
			path, truncate(bytes.TrimSpace(line), 200))
	}
	return g.QMP, nil
}

// interruptOnDone makes a blocked read or write on a connection return when
// ctx is cancelled, by moving its deadline into the past. The returned stop
// function must be called before the deadline is reset, and guarantees that
// the interruption is not still in flight when it returns.
func interruptOnDone(ctx context.Context, setDeadline func(time.Time) error) (stop func()) {
	fired := make(chan struct{})
	stopAfter := context.AfterFunc(ctx, func() {
		setDeadline(time.Unix(1, 0))
		close(fired)
	})
	return func() {
		if !stopAfter() {
			<-fired
		}
	}
}

// Version is the QEMU version from the greeting.
func (c *Client) Version() goqmp.Version { return c.version }

// Capabilities lists the optional QMP capabilities QEMU offered in its
// greeting (none of them is enabled).
func (c *Client) Capabilities() []string { return append([]string(nil), c.caps...) }

// Done is closed when the connection has ended, for whatever reason.
func (c *Client) Done() <-chan struct{} { return c.done }

// Err says why the connection ended, or is nil while it is up.
func (c *Client) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Close ends the connection: pending commands fail and every subscription
// is closed, its undelivered events discarded. It waits for the client's
// goroutines to finish and always returns nil (the error is for io.Closer).
func (c *Client) Close() error {
	c.fail(errcode.Wrap(errcode.QMPError, net.ErrClosed, "the QMP client was closed"))
	<-c.readerDone
	c.mu.Lock()
	subs := make([]*Subscription, 0, len(c.subs))
	for s := range c.subs {
		subs = append(subs, s)
	}
	c.mu.Unlock()
	for _, s := range subs {
		s.Close()
		<-s.pumpDone
	}
	return nil
}

// fail ends the connection with err, unless it has ended already.
func (c *Client) fail(err error) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.err = err
	close(c.done)
	c.mu.Unlock()
	c.conn.Close()
}

// Execute runs a QMP command and decodes its "return" member into result
// unless result is nil. args, if not nil, is encoded as the "arguments"
// member. If ctx ends first Execute returns at once; QEMU still runs the
// command and its late reply is discarded.
//
// A refusal by QEMU is returned as an *errcode.Error with code QMP_ERROR that
// wraps an *Error; every other failure carries code QMP_ERROR too.
func (c *Client) Execute(ctx context.Context, command string, args, result any) error {
	return c.ExecuteWithFile(ctx, command, args, result, nil)
}

// ExecuteWithFile is Execute with f's descriptor attached to the command
// (SCM_RIGHTS), as getfd and add-fd expect. QEMU receives a duplicate; the
// caller still owns f and may close it once ExecuteWithFile returns. A nil f
// sends no descriptor.
func (c *Client) ExecuteWithFile(ctx context.Context, command string, args, result any, f *os.File) error {
	r, err := c.roundTrip(ctx, command, f, func(id uint64) ([]byte, error) {
		return json.Marshal(request{Execute: command, Arguments: args, ID: id})
	})
	if err != nil {
		return err
	}
	if result != nil && len(r.msg.Return) > 0 {
		if err := json.Unmarshal(r.msg.Return, result); err != nil {
			return errcode.Wrap(errcode.QMPError, err, "qmp: %s: decoding QEMU's reply", command)
		}
	}
	return nil
}

// roundTrip sends the command that encode builds around an id and waits for
// the reply carrying that id.
func (c *Client) roundTrip(ctx context.Context, command string, f *os.File, encode func(id uint64) ([]byte, error)) (*reply, error) {
	if err := ctx.Err(); err != nil {
		return nil, errcode.Wrap(errcode.QMPError, err, "qmp: %s: not sent", command)
	}
	ctx, cancel := context.WithTimeout(ctx, commandTimeout)
	defer cancel()

	ch := make(chan *reply, 1) // the reader sends at most once and must never block
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		return nil, errcode.Wrap(errcode.QMPError, err, "qmp: %s", command)
	}
	c.nextID++
	id := c.nextID
	c.pending[id] = ch
	c.mu.Unlock()

	b, err := encode(id)
	if err != nil {
		c.forget(id)
		return nil, errcode.Wrap(errcode.Internal, err, "qmp: %s: encoding the command", command)
	}
	if err := c.write(ctx, append(b, '\n'), f); err != nil {
		c.forget(id)
		return nil, errcode.Wrap(errcode.QMPError, err, "qmp: %s: sending the command", command)
	}

	select {
	case r := <-ch:
		return r, replyError(command, r)
	case <-ctx.Done():
		// A reply that raced with the deadline still wins: the command ran.
		select {
		case r := <-ch:
			return r, replyError(command, r)
		default:
		}
		c.forget(id)
		return nil, errcode.Wrap(errcode.QMPError, ctx.Err(), "qmp: %s: no reply from QEMU", command)
	case <-c.done:
		select {
		case r := <-ch:
			return r, replyError(command, r)
		default:
		}
		c.forget(id)
		return nil, errcode.Wrap(errcode.QMPError, c.Err(), "qmp: %s", command)
	}
}

func (c *Client) forget(id uint64) {
	c.mu.Lock()
	delete(c.pending, id)
	c.mu.Unlock()
}

func replyError(command string, r *reply) error {
	if r.msg.Error == nil {
		return nil
	}
	qerr := &Error{Command: command, Class: r.msg.Error.Class, Desc: r.msg.Error.Desc}
	return errcode.Wrap(errcode.QMPError, qerr, "")
}

// write sends one whole command. A peer that stops reading (QEMU suspends a
// monitor whose command queue is full) would block a write forever, so the
// write is bounded by ctx.
func (c *Client) write(ctx context.Context, b []byte, f *os.File) error {
	select {
	case c.writeSem <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	case <-c.done:
		return c.Err()
	}
	defer func() { <-c.writeSem }()

	if dl, ok := ctx.Deadline(); ok {
		c.conn.SetWriteDeadline(dl)
	}
	stop := interruptOnDone(ctx, c.conn.SetWriteDeadline)
	n, err := c.send(b, f)
	stop()
	c.conn.SetWriteDeadline(time.Time{})
	if err == nil {
		return nil
	}
	if n > 0 {
		// QEMU holds part of a command; anything written next would be
		// parsed as its continuation, so the connection is unusable.
		c.fail(errcode.Wrap(errcode.QMPError, err, "writing to the QEMU monitor was interrupted in the middle of a command"))
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return context.DeadlineExceeded
	}
	return err
}

// send writes b, with f's descriptor attached to its first byte if f is not
// nil, and reports how many bytes were written.
func (c *Client) send(b []byte, f *os.File) (int, error) {
	if f == nil {
		return c.conn.Write(b)
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var n int
	var werr error
	// Control keeps the descriptor open while it is sent, without putting
	// f into blocking mode as f.Fd() would.
	err = rc.Control(func(fd uintptr) {
		n, _, werr = c.conn.WriteMsgUnix(b, syscall.UnixRights(int(fd)), nil)
	})
	if err != nil {
		return 0, err
	}
	if werr != nil || n == len(b) {
		return n, werr
	}
	// One sendmsg on a stream socket may take only part of the bytes; the
	// descriptor travelled with that part.
	m, err := c.conn.Write(b[n:])
	return n + m, err
}

// readLoop is the only reader of the connection. It routes replies to their
// waiting callers and events to subscribers, never blocking on either.
func (c *Client) readLoop(br *bufio.Reader) {
	defer close(c.readerDone)
	for {
		// readLine grows its result as needed (query-qmp-schema's reply is
		// far larger than any fixed buffer one would pick), up to the cap.
		line, err := readLine(br)
		if err != nil {
			c.fail(readError(err, len(bytes.TrimSpace(line)) > 0))
			return
		}
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		// Safely: the line is what QEMU sent; a panic reading it ends
		// this connection, not the process.
		if err := errcode.Safely(func() error { return c.dispatch(line) }); err != nil {
			c.fail(err)
			return
		}
	}
}

// errLineTooLong ends a connection whose peer sent a line over MaxLineBytes.
var errLineTooLong = fmt.Errorf("QEMU sent a QMP message longer than %d MiB, which no real QEMU does: the connection was closed", MaxLineBytes>>20)

// readLine reads one line, newline included, failing with errLineTooLong as
// soon as it passes MaxLineBytes: it never holds more than the cap, whatever
// the peer sends.
func readLine(br *bufio.Reader) ([]byte, error) {
	// Full buffers are kept as pieces and joined once at the end: growing
	// one slice would allocate several times the line on the way.
	var pieces [][]byte
	n := 0
	for {
		frag, err := br.ReadSlice('\n')
		n += len(frag)
		if n > MaxLineBytes {
			return nil, errLineTooLong
		}
		if err == bufio.ErrBufferFull {
			// frag is the reader's own buffer, overwritten by the next read.
			pieces = append(pieces, bytes.Clone(frag))
			continue
		}
		line := make([]byte, 0, n)
		for _, p := range pieces {
			line = append(line, p...)
		}
		return append(line, frag...), err
	}
}

func readError(err error, partial bool) error {
	// A peer that closes with our commands still unread resets the
	// connection instead of ending it: the same thing to us.
	closed := errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)
	switch {
	case errors.Is(err, errLineTooLong):
		return errcode.Wrap(errcode.QMPError, err, "reading from the QEMU monitor")
	case closed && partial:
		return errcode.Wrap(errcode.QMPError, io.ErrUnexpectedEOF,
			"QEMU closed the monitor connection in the middle of a message")
	case closed:
		return errcode.Wrap(errcode.QMPError, err, "QEMU closed the monitor connection")
	}
	return errcode.Wrap(errcode.QMPError, err, "reading from the QEMU monitor")
}

// dispatch routes one message. An error means the stream can no longer be
// trusted and the connection must end.
func (c *Client) dispatch(line []byte) error {
	var m message
	if err := json.Unmarshal(line, &m); err != nil {
		return errcode.Wrap(errcode.QMPError, err, "QEMU sent a malformed QMP message %q", truncate(bytes.TrimSpace(line), 200))
	}
	if m.Event != "" {
		c.publish(&m)
		return nil
	}
	// Every command we send has a numeric id. A reply without one (QEMU's
	// answer to input it could not parse) or with a foreign id has nobody
	// waiting for it.
	id, err := strconv.ParseUint(string(m.ID), 10, 64)
	if err != nil {
		return nil
	}
	c.mu.Lock()
	ch := c.pending[id]
	delete(c.pending, id)
	c.mu.Unlock()
	if ch != nil { // nil when the caller gave up: the late reply is dropped
		ch <- &reply{line: line, msg: m}
	}
	return nil
}

// PeerPID is the pid of the process at the other end of the monitor
// socket (SO_PEERCRED, taken when it connected), as this process's pid
// namespace sees it: 0 when the kernel cannot tell (the peer is in a pid
// namespace this one does not see).
func (c *Client) PeerPID() (int, error) {
	rc, err := c.conn.SyscallConn()
	if err != nil {
		return 0, err
	}
	var cred *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, err
	}
	if serr != nil {
		return 0, serr
	}
	return int(cred.Pid), nil
}
