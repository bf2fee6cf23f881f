package fusefs

import (
	"context"
	"errors"
	"log/slog"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Option configures Serve.
type Option func(*server)

// WithWorkers bounds how many requests are handled at once (default 64). A
// Read that blocks holds a worker. When all are busy the server stops
// reading until one is free, and requests (interrupts too) wait in the
// kernel; the kernel's own limit on background reads (12 by default) and
// the threads that fault keep well below the default.
func WithWorkers(n int) Option {
	return func(s *server) { s.workers = max(n, 1) }
}

// WithLogger logs what the kernel cannot be told: a panic in a handler (the
// request is answered EIO) or a malformed request.
func WithLogger(l *slog.Logger) Option {
	return func(s *server) { s.log = l }
}

// errServerStopping is the cause a Read's ctx carries when Serve returns:
// such a Read is not answered, and the next server gets it by RESEND.
var errServerStopping = errors.New("FUSE server stopping")

// errInterrupted is the cause when the kernel interrupted the request (its
// reader got a signal): it is answered EINTR.
var errInterrupted = errors.New("FUSE request interrupted")

type server struct {
	conn    *Conn
	tree    Tree
	workers int
	log     *slog.Logger

	mu       sync.Mutex
	inflight map[uint64]context.CancelCauseFunc // READs, by unique
}

var bufPool = sync.Pool{New: func() any { return new([bufSize]byte) }}

// Serve answers the kernel's requests from tree (one Serve per Conn) until ctx is done (then it
// stops reading, leaves the READs that have not finished to the next
// server's RESEND, and returns ctx's error) or the connection ends (unmount
// or abort: it returns nil). It returns after every handler has.
func (c *Conn) Serve(ctx context.Context, tree Tree, opts ...Option) error {
	s := &server{conn: c, tree: tree, workers: 64, log: slog.New(slog.DiscardHandler),
		inflight: map[uint64]context.CancelCauseFunc{}}
	for _, o := range opts {
		o(s)
	}
	wake, release, err := wakeOn(ctx)
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "FUSE server")
	}
	defer release()
	base, stop := context.WithCancelCause(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	err = s.loop(ctx, base, wake, &wg)
	stop(errServerStopping)
	wg.Wait()
	return err
}

// loop reads requests and hands each to a worker. INTERRUPT, FORGET and
// DESTROY need none and are handled here.
func (s *server) loop(ctx, base context.Context, wake int, wg *sync.WaitGroup) error {
	sem := make(chan struct{}, s.workers)
	for {
		buf := bufPool.Get().(*[bufSize]byte)
		n, err := s.conn.read(ctx, buf[:], wake)
		if err != nil {
			bufPool.Put(buf)
			return readEnd(ctx, err)
		}
		r, err := parseRequest(buf[:n])
		if s.inline(r, err) {
			bufPool.Put(buf)
			if r.op == opDestroy && err == nil {
				return nil
			}
			continue
		}
		rctx := s.track(base, r)
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { s.untrack(r); bufPool.Put(buf); <-sem; wg.Done() }()
			s.handle(rctx, r)
		}()
	}
}

// readEnd is what Serve returns when reading stopped with err.
func readEnd(ctx context.Context, err error) error {
	switch {
	case ctx.Err() != nil:
		return ctx.Err()
	case errors.Is(err, unix.ENODEV):
		return nil
	}
	return errcode.Wrap(errcode.Internal, err, "reading /dev/fuse")
}

// inline handles what needs no worker, and says whether it did.
func (s *server) inline(r request, err error) bool {
	switch {
	case err != nil:
		s.log.Error("FUSE: malformed request", "error", err)
		if r.unique != 0 {
			s.conn.write(errMessage(r.unique, unix.EIO))
		}
	case r.op == opInterrupt:
		s.interrupt(r)
	case r.op == opForget, r.op == opBatchForget:
		// node IDs are the tree's, never counted: nothing to forget
	case r.op == opDestroy:
		s.conn.write(outMessage(r.unique, 0, 0))
	default:
		return false
	}
	return true
}

// track gives a READ a context that an INTERRUPT of its unique cancels.
func (s *server) track(base context.Context, r request) context.Context {
	if r.op != opRead {
		return base
	}
	ctx, cancel := context.WithCancelCause(base)
	s.mu.Lock()
	s.inflight[r.unique] = cancel
	s.mu.Unlock()
	return ctx
}

func (s *server) untrack(r request) {
	s.mu.Lock()
	if cancel, ok := s.inflight[r.unique]; ok {
		delete(s.inflight, r.unique)
		cancel(nil)
	}
	s.mu.Unlock()
}

// interrupt cancels the READ an INTERRUPT names. One that already finished
// needs nothing: the kernel has its answer.
func (s *server) interrupt(r request) {
	target, err := r.u64()
	if err != nil {
		return
	}
	s.mu.Lock()
	cancel := s.inflight[target]
	s.mu.Unlock()
	if cancel != nil {
		cancel(errInterrupted)
	}
}

// handle answers one request. A panic in it (a bug here or in the tree) is
// answered EIO and logged: it must never take the agent down.
func (s *server) handle(ctx context.Context, r request) {
	defer func() {
		if v := recover(); v != nil {
			s.log.Error("FUSE: handler panicked", "opcode", r.op, "error", errcode.Recovered(v))
			s.conn.write(errMessage(r.unique, unix.EIO))
		}
	}()
	if m := s.dispatch(ctx, r); m != nil {
		s.conn.write(m)
	}
}
