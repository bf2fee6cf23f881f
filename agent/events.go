package agent

import (
	"sync"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
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
	c       chan api.Event
	filter  string                   // operation id, or "" for all
	visible func(api.Operation) bool // what its caller may see
}

const subscriberBuffer = 256

func newBroker() *broker { return &broker{subs: map[*subscriber]struct{}{}} }

func (b *broker) subscribe(filter string, visible func(api.Operation) bool) *subscriber {
	s := &subscriber{c: make(chan api.Event, subscriberBuffer), filter: filter, visible: visible}
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
	ev := api.Event{Type: "operation", Time: time.Now().UTC(), Operation: o}
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
