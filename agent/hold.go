package agent

import "context"

// opHold is one of a caller's operations (limits.go), taken before the
// request's work (resolving the VM, reading keys), so that a caller at its
// limit costs the agent no more than the refusal. The operation keeps it
// until it ends; a request that starts none drops it.
type opHold struct {
	s    *Server
	who  string
	kept bool
}

// holdOperation takes one of the request's caller's operations, or is BUSY.
func (s *Server) holdOperation(ctx context.Context) (*opHold, error) {
	c, err := requestCaller(ctx)
	if err != nil {
		return nil, err
	}
	who := holderOf(c)
	if err := s.held.take(who, operations); err != nil {
		s.refused(who, operations)
		return nil, err
	}
	return &opHold{s: s, who: who}, nil
}

// keep hands the hold to o: end gives it back.
func (h *opHold) keep(o *op) {
	h.kept = true
	o.holder = h.who
}

// drop gives the hold back, unless an operation kept it.
func (h *opHold) drop() {
	if !h.kept {
		h.s.held.give(h.who, operations)
	}
}
