package agent

// What one caller may hold in the agent at once.
//
// Each open connection holds a goroutine, buffers and two descriptors (the
// socket and the caller's pidfd), each event stream a subscription, each
// operation its VM's files and a goroutine until it ends. None of that
// is the caller's to size: beyond its limits a caller is refused with
// BUSY, naming the limit, and what it holds already is untouched. A
// caller here is what the agent's policy knows (caller.go): the callers of
// one pod namespace count together (a tenant gains nothing from more
// pods), the processes on the node together, and the connections whose
// caller the agent could not place together.

import (
	"sync"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Limits bounds what one caller may hold at once; 0 takes the default.
type Limits struct {
	// Connections: open connections, idle ones and streams included.
	Connections int
	// Streams: event streams (GET /v1/events).
	Streams int
	// Operations: checkpoints, restores and prepares pending or running.
	Operations int
}

// The defaults: enough for a controller that follows every operation of a
// node's VMs with its own stream and polls beside them.
const (
	DefaultMaxConnectionsPerCaller = 64
	DefaultMaxStreamsPerCaller     = 16
	DefaultMaxOperationsPerCaller  = 32
)

func (l Limits) withDefaults() Limits {
	if l.Connections <= 0 {
		l.Connections = DefaultMaxConnectionsPerCaller
	}
	if l.Streams <= 0 {
		l.Streams = DefaultMaxStreamsPerCaller
	}
	if l.Operations <= 0 {
		l.Operations = DefaultMaxOperationsPerCaller
	}
	return l
}

// resource is what a limit counts.
type resource int

const (
	connections resource = iota
	streams
	operations
)

var resourceNames = [...]struct{ label, what, flag string }{
	connections: {"connections", "open connections", "--max-connections-per-caller"},
	streams:     {"streams", "event streams", "--max-streams-per-caller"},
	operations:  {"operations", "operations pending or running", "--max-operations-per-caller"},
}

// holdings counts what each caller holds.
type holdings struct {
	limits Limits
	mu     sync.Mutex
	held   map[holding]int
	// when each refusal was last logged, and how many since
	logged   map[holding]time.Time
	unlogged map[holding]int
}

type holding struct {
	who  string // holderOf
	what resource
}

func newHoldings(l Limits) *holdings {
	return &holdings{limits: l.withDefaults(), held: map[holding]int{}, logged: map[holding]time.Time{}, unlogged: map[holding]int{}}
}

func (h *holdings) max(what resource) int {
	switch what {
	case connections:
		return h.limits.Connections
	case streams:
		return h.limits.Streams
	}
	return h.limits.Operations
}

// take counts one more of what for who, or returns BUSY if who holds its
// limit already. Each take that succeeds is matched by a give.
func (h *holdings) take(who string, what resource) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	k := holding{who, what}
	if n := h.held[k]; n >= h.max(what) {
		name := resourceNames[what]
		return errcode.New(errcode.Busy, "this caller (%s) holds %d %s already, the most this agent allows one caller (its %s): end one and try again",
			who, n, name.what, name.flag)
	}
	h.held[k]++
	return nil
}

func (h *holdings) give(who string, what resource) {
	h.mu.Lock()
	defer h.mu.Unlock()
	k := holding{who, what}
	if h.held[k]--; h.held[k] <= 0 {
		delete(h.held, k)
	}
}

// count is what who holds of what now.
func (h *holdings) count(who string, what resource) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.held[holding{who, what}]
}

// unplaced is the holder of connections whose caller the agent could
// not place: they share one set of limits.
const unplaced = "a caller the agent could not place"

// holderOf is who c's holdings count against: its namespace, or the node.
func holderOf(c Caller) string {
	if c.Namespace == "" {
		return "the node's processes"
	}
	return "namespace " + c.Namespace
}

// refused logs a caller refused for its limit, at most once per
// refusalLogEvery for each caller and resource (a caller that tries
// thousands of times makes one line, not thousands), and counts it.
func (s *Server) refused(who string, what resource) {
	s.metrics.refusals.WithLabelValues(resourceNames[what].label).Inc()
	s.held.mu.Lock()
	k := holding{who, what}
	last, n := s.held.logged[k], s.held.unlogged[k]+1
	if time.Since(last) < refusalLogEvery {
		s.held.unlogged[k] = n
		s.held.mu.Unlock()
		return
	}
	s.held.logged[k], s.held.unlogged[k] = time.Now(), 0
	s.held.mu.Unlock()
	s.log.Warn("refused a caller over its limit", "caller", who, "resource", resourceNames[what].what,
		"limit", s.held.max(what), "flag", resourceNames[what].flag, "refusals", n)
}

const refusalLogEvery = 10 * time.Second
