package agent

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"runtime/debug"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// A panic in any of the agent's goroutines (a request's handler, an
// operation, the container watch) ends only what that goroutine was doing,
// as INTERNAL: never the agent, whose other operations and VMs depend on
// it. The panic's value and where it happened go into the agent's log at
// level error, its stack at level debug (--log-level debug; both in the
// JSON log on the agent's stderr, the DaemonSet pod's log). Callers get the
// INTERNAL error, never a stack.

// Recovered logs a panic recovered in one of the agent's goroutines (or its
// resolver's) and returns its error. Call it from the deferred function
// that recovered: the stack is still the panic's.
func Recovered(log *slog.Logger, v any, where string, attrs ...any) error {
	err := errcode.Recovered(v)
	log.Error("recovered from a bug in "+where, append(attrs, "err", err)...)
	log.Debug("stack of the bug in "+where, append(attrs, "stack", string(debug.Stack()))...)
	return err
}

// runWork runs an operation's work. A panic in it fails the operation as
// INTERNAL, and puts its VM back as a restarted agent would (putBack): a
// checkpoint that the journal says stopped a running VM, and did not
// finish, continues it. (A panic under vmstate's guard never gets here:
// the guard continues the VM and returns the error.)
func (s *Server) runWork(o *op, log *slog.Logger, work func(context.Context) error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = Recovered(log, v, "an operation")
			if e, ok, jerr := s.journal.read(o.id); jerr == nil && ok {
				ctx, cancel := context.WithTimeout(context.WithoutCancel(o.ctx), cleanupTimeout)
				defer cancel()
				err = errcode.Wrap(errcode.Internal, err, "the operation failed%s", s.putBack(ctx, e, log))
			}
		}
	}()
	return work(o.ctx)
}

// cleanupTimeout bounds putting a VM back after an operation panicked.
const cleanupTimeout = 30 * time.Second

// recovering answers a request whose handler panicked with INTERNAL, if
// nothing was answered yet; otherwise (an event stream under way) it ends
// the connection, as net/http does for http.ErrAbortHandler, without
// logging a stack on the agent's stderr.
func recovering(log *slog.Logger, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rw := &answerWatch{ResponseWriter: w}
		defer func() {
			v := recover()
			if v == nil {
				return
			}
			if err, ok := v.(error); ok && errors.Is(err, http.ErrAbortHandler) {
				panic(v) // a handler's own way to drop the connection
			}
			err := Recovered(log, v, "a request's handler", "method", r.Method, "path", r.URL.Path)
			if rw.answered {
				panic(http.ErrAbortHandler)
			}
			writeError(w, err)
		}()
		h.ServeHTTP(rw, r)
	})
}

// answerWatch notes whether a handler has begun its answer. It keeps what
// the handlers use of the ResponseWriter: Flush (event streams), and
// Unwrap for http.ResponseController (read deadlines).
type answerWatch struct {
	http.ResponseWriter
	answered bool
}

func (a *answerWatch) WriteHeader(status int) {
	a.answered = true
	a.ResponseWriter.WriteHeader(status)
}

func (a *answerWatch) Write(b []byte) (int, error) {
	a.answered = true
	return a.ResponseWriter.Write(b)
}

func (a *answerWatch) Flush() {
	a.answered = true
	if f, ok := a.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (a *answerWatch) Unwrap() http.ResponseWriter { return a.ResponseWriter }
