package qmp

import (
	"context"
	"encoding/json"
	"sync"

	goqmp "github.com/digitalocean/go-qemu/qmp"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// EventQueueLimit is how many undelivered events a subscription holds, and
// EventQueueBytes how many bytes of them (as QEMU sent them; decoded, they
// take a few times more). When a subscriber falls further behind, its oldest
// events are dropped (and counted by Dropped): a stalled subscriber must
// never stall command replies, nor grow memory without bound, even when
// QEMU floods it with large events. One event larger than EventQueueBytes
// (up to MaxLineBytes) is still delivered, alone in the queue.
const (
	EventQueueLimit = 4096
	EventQueueBytes = 8 << 20
)

// eventOverhead is what an event costs in the queue besides its data.
const eventOverhead = 128

type queuedEvent struct {
	ev   goqmp.Event
	size int
}

// Subscription receives the events QEMU sends after it was created.
type Subscription struct {
	c        *Client
	out      chan goqmp.Event
	wake     chan struct{} // capacity 1: "the queue may have grown"
	closed   chan struct{}
	once     sync.Once
	pumpDone chan struct{}

	mu      sync.Mutex
	queue   []queuedEvent
	bytes   int // sum of the queue's sizes
	dropped uint64
}

// Subscribe starts receiving events. Only events read from the connection
// after Subscribe returns are delivered. Close the subscription when done.
func (c *Client) Subscribe() *Subscription {
	s := &Subscription{
		c:        c,
		out:      make(chan goqmp.Event),
		wake:     make(chan struct{}, 1),
		closed:   make(chan struct{}),
		pumpDone: make(chan struct{}),
	}
	c.mu.Lock()
	if c.err == nil {
		c.subs[s] = struct{}{}
	}
	c.mu.Unlock()
	go s.pump()
	return s
}

// publish hands an event to every subscription. It is called by the reader
// and never blocks.
func (c *Client) publish(m *message) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.subs) == 0 {
		return
	}
	ev := goqmp.Event{Event: m.Event, Timestamp: m.Timestamp}
	if len(m.Data) > 0 {
		if err := json.Unmarshal(m.Data, &ev.Data); err != nil {
			return // data that is not an object; go-qemu's Event cannot hold it
		}
	}
	size := eventOverhead + len(m.Event) + len(m.Data)
	for s := range c.subs {
		s.push(queuedEvent{ev, size})
	}
}

// C delivers events in the order QEMU sent them. It is closed by Close (the
// subscription's or the client's) and, when QEMU ends the connection, once
// the events that came before the end have been delivered, so a final
// SHUTDOWN is not lost. Event.Data is shared between subscriptions: do not
// modify it.
func (s *Subscription) C() <-chan goqmp.Event { return s.out }

// Dropped counts the events discarded because the subscriber fell more than
// EventQueueLimit events or EventQueueBytes behind.
func (s *Subscription) Dropped() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dropped
}

// Close stops the subscription and discards its queued events.
func (s *Subscription) Close() {
	s.once.Do(func() {
		s.c.mu.Lock()
		delete(s.c.subs, s)
		s.c.mu.Unlock()
		close(s.closed)
		s.mu.Lock()
		s.queue, s.bytes = nil, 0
		s.mu.Unlock()
	})
}

// Wait returns the first event for which match returns true (any event if
// match is nil), discarding the others. It fails when ctx ends, when the
// connection ends or when the subscription is closed. Subscribe before
// issuing the command whose event you wait for, or the event may come first.
func (s *Subscription) Wait(ctx context.Context, match func(goqmp.Event) bool) (goqmp.Event, error) {
	for {
		select {
		case ev, ok := <-s.out:
			if !ok {
				if err := s.c.Err(); err != nil {
					return goqmp.Event{}, errcode.Wrap(errcode.QMPError, err, "qmp: waiting for an event")
				}
				return goqmp.Event{}, errcode.New(errcode.QMPError, "qmp: waiting for an event: the subscription was closed")
			}
			if match == nil || match(ev) {
				return ev, nil
			}
		case <-ctx.Done():
			return goqmp.Event{}, errcode.Wrap(errcode.QMPError, ctx.Err(), "qmp: no matching event from QEMU")
		}
	}
}

func (s *Subscription) push(q queuedEvent) {
	s.mu.Lock()
	for len(s.queue) > 0 && (len(s.queue) >= EventQueueLimit || s.bytes+q.size > EventQueueBytes) {
		s.bytes -= s.queue[0].size
		s.queue[0] = queuedEvent{} // let the dropped event's data be collected
		s.queue = s.queue[1:]
		s.dropped++
	}
	s.queue = append(s.queue, q)
	s.bytes += q.size
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *Subscription) pop() (goqmp.Event, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.queue) == 0 {
		return goqmp.Event{}, false
	}
	q := s.queue[0]
	s.queue[0] = queuedEvent{}
	s.queue = s.queue[1:]
	s.bytes -= q.size
	return q.ev, true
}

func (s *Subscription) queued() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.queue)
}

// pump moves events from the queue to the channel, so that the reader only
// ever appends to a queue.
func (s *Subscription) pump() {
	defer close(s.pumpDone)
	defer close(s.out)
	for {
		ev, ok := s.pop()
		if !ok {
			select {
			case <-s.wake:
				continue
			case <-s.closed:
				return
			case <-s.c.done:
				// Nothing more will be queued; deliver what was.
				if s.queued() > 0 {
					continue
				}
				return
			}
		}
		select {
		case s.out <- ev:
		case <-s.closed:
			return
		}
	}
}
