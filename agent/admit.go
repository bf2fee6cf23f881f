package agent

// Placing each connection's caller before it is served.
//
// A connection's caller comes from the peer credentials the kernel
// recorded at connect() (caller_linux.go), so the agent knows it before
// the caller sends a byte: the connection counts against its caller's
// connection limit from its accept, while it is idle or slow to send its
// request too, and one beyond the limit is answered BUSY and closed before
// the HTTP server sees it. Placing a caller takes the agent's own work
// (reads in /proc, a containerd lookup), never the caller's: a bounded
// number run at once, and the accept loop waits for a free one.

import (
	"context"
	"errors"
	"net"
	"net/http"
	"sync"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// maxPlacing bounds the connections being placed at once.
const maxPlacing = 16

// admitting is a listener whose Accept returns connections whose caller
// is placed and within its connection limit.
type admitting struct {
	net.Listener
	s        *Server
	ctx      context.Context
	refusals *refusals
	placing  chan struct{}
	conns    chan net.Conn
	errs     chan error
	done     chan struct{}
	close    sync.Once
}

func (s *Server) admitting(ctx context.Context, ln net.Listener, r *refusals) *admitting {
	a := &admitting{Listener: ln, s: s, ctx: ctx, refusals: r, placing: make(chan struct{}, maxPlacing),
		conns: make(chan net.Conn), errs: make(chan error), done: make(chan struct{})}
	go a.loop()
	return a
}

func (a *admitting) loop() {
	for {
		c, err := a.Listener.Accept()
		if err != nil {
			select {
			case a.errs <- err:
			case <-a.done:
				return
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue // the server backs off from a temporary error and asks again
		}
		select {
		case a.placing <- struct{}{}:
		case <-a.done:
			c.Close()
			return
		}
		go a.admit(c)
	}
}

// admit places c's caller and hands c to the server, or refuses it.
func (a *admitting) admit(c net.Conn) {
	defer func() { <-a.placing }()
	id, ok := c.(connIdentity)
	if !ok {
		a.refusals.refuse(c, http.StatusForbidden, errNoCaller)
		return
	}
	who := unplaced
	if caller, err := id.identify(a.ctx, a.s); err == nil {
		who = holderOf(caller)
	}
	// A connection whose caller could not be placed is still served: its
	// /v1 requests get the reason (FORBIDDEN), and /healthz answers.
	if err := a.s.held.take(who, connections); err != nil {
		a.s.refused(who, connections)
		a.refusals.refuse(c, HTTPStatus(errcode.Of(err)), err)
		return
	}
	h := &heldConn{Conn: c, connIdentity: id, release: func() { a.s.held.give(who, connections) }}
	select {
	case a.conns <- h:
	case <-a.done:
		h.Close()
	}
}

func (a *admitting) Accept() (net.Conn, error) {
	select {
	case c := <-a.conns:
		return c, nil
	case err := <-a.errs:
		return nil, err
	case <-a.done:
		return nil, net.ErrClosed
	}
}

func (a *admitting) Close() error {
	a.close.Do(func() { close(a.done) })
	return a.Listener.Close()
}

// heldConn is an admitted connection: closing it gives its place back.
type heldConn struct {
	net.Conn
	connIdentity
	release func()
	once    sync.Once
}

func (h *heldConn) Close() error {
	h.once.Do(h.release)
	return h.Conn.Close()
}

// CloseWrite half-closes the connection, where it can: net/http does so
// before it closes a connection after an error answer, so that the caller
// reads the answer rather than a reset.
func (h *heldConn) CloseWrite() error {
	if cw, ok := h.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}
