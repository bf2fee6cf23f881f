package agent

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// broker fans operation events out to the event streams. Publishing never
// blocks: a subscriber that falls behind by more than its buffer is
// disconnected (its stream ends, and the client re-reads the operation).
type broker struct {
	mu     sync.Mutex
	subs   map[*subscriber]struct{}
	closed bool
}

type subscriber struct {
	// c carries events shared by every subscriber: a subscription costs
	// its buffer of pointers, not copies of operations.
	c       chan *api.Event
	filter  string                   // operation id, or "" for all
	visible func(api.Operation) bool // what its caller may see
}

const subscriberBuffer = 256

// streamWriteTimeout bounds one event's write: a stream whose caller does
// not read for this long ends (the client re-reads the operation).
var streamWriteTimeout = 10 * time.Second

func newBroker() *broker { return &broker{subs: map[*subscriber]struct{}{}} }

func (b *broker) subscribe(filter string, visible func(api.Operation) bool) *subscriber {
	s := &subscriber{c: make(chan *api.Event, subscriberBuffer), filter: filter, visible: visible}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		close(s.c)
		return s
	}
	b.subs[s] = struct{}{}
	return s
}

func (b *broker) unsubscribe(s *subscriber) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.subs[s]; ok {
		delete(b.subs, s)
		close(s.c)
	}
}

func (b *broker) publish(o api.Operation) {
	ev := &api.Event{Type: "operation", Time: time.Now().UTC(), Operation: o}
	b.mu.Lock()
	defer b.mu.Unlock()
	for s := range b.subs {
		if s.filter != "" && s.filter != o.ID || !s.visible(o) {
			continue
		}
		select {
		case s.c <- ev:
		default:
			delete(b.subs, s)
			close(s.c)
		}
	}
}

// close ends every stream (at shutdown).
func (b *broker) close() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	for s := range b.subs {
		delete(b.subs, s)
		close(s.c)
	}
}

// serveEvents streams operation events. It first sends the current state
// of the operations asked for, so that a client that subscribes after
// starting an operation cannot miss its end.
func (s *Server) serveEvents(w http.ResponseWriter, r *http.Request) {
	flusher, ok := w.(http.Flusher)
	if !ok {
		writeError(w, errcode.New(errcode.Internal, "streaming unsupported"))
		return
	}
	c, _ := callerFrom(r.Context())
	who := holderOf(c)
	if err := s.held.take(who, streams); err != nil {
		s.refused(who, streams)
		writeError(w, err)
		return
	}
	defer s.held.give(who, streams)
	filter := r.URL.Query().Get("operation")
	var initial []api.Operation
	if filter != "" {
		o, err := s.visibleOp(r.Context(), filter)
		if err != nil {
			writeError(w, err)
			return
		}
		sub := s.events.subscribe(filter, c.sees)
		defer s.events.unsubscribe(sub)
		initial = append(initial, o.snapshot())
		s.stream(w, r, flusher, sub, initial)
		return
	}
	sub := s.events.subscribe("", c.sees)
	defer s.events.unsubscribe(sub)
	s.stream(w, r, flusher, sub, s.ops.list(c.sees))
}

func (s *Server) stream(w http.ResponseWriter, r *http.Request, flusher http.Flusher, sub *subscriber, initial []api.Operation) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	flusher.Flush() // a subscriber learns at once that the stream is open
	rc := http.NewResponseController(w)
	send := func(ev *api.Event) bool {
		// A caller that stops reading ends its stream: the write fails
		// at the deadline instead of holding the stream for good.
		_ = rc.SetWriteDeadline(time.Now().Add(streamWriteTimeout))
		b, _ := json.Marshal(ev)
		if _, err := fmt.Fprintf(w, "event: %s\ndata: %s\n\n", ev.Type, b); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	for _, o := range initial {
		if !send(&api.Event{Type: "operation", Time: o.Updated, Operation: o}) {
			return
		}
	}
	for {
		select {
		case ev, ok := <-sub.c:
			if !ok || !send(ev) {
				return
			}
		case <-r.Context().Done():
			return
		}
	}
}
