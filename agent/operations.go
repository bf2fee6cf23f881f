package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// op is one operation and what runs it.
type op struct {
	id     string
	key    string // the VM: pod UID and container
	holder string // whose operations it counts against (limits.go)
	cancel context.CancelCauseFunc
	ctx    context.Context
	done   chan struct{}

	mu           sync.Mutex
	data         api.Operation
	lastProgress time.Time
}

func vmKey(podUID, container string) string { return podUID + "/" + container }

// newOp makes an operation whose context ends when it is cancelled or,
// with cause *opTimeout, once timeout has passed.
func newOp(kind string, vm api.VMRef, target *api.Target, timeout time.Duration) *op {
	var b [8]byte
	_, _ = rand.Read(b[:])
	now := time.Now().UTC()
	deadline, stopTimer := context.WithTimeoutCause(context.Background(), timeout, &opTimeout{timeout})
	ctx, cancelCtx := context.WithCancelCause(deadline)
	// Every operation ends with a cancel (run defers one), which stops the timer.
	cancel := func(cause error) { cancelCtx(cause); stopTimer() }
	return &op{
		id: hex.EncodeToString(b[:]), key: vmKey(vm.PodUID, vm.Container),
		ctx: ctx, cancel: cancel, done: make(chan struct{}),
		data: api.Operation{ID: hex.EncodeToString(b[:]), Kind: kind, State: api.StatePending, VM: vm, Target: target, Namespace: targetNamespace(target), Created: now, Updated: now},
	}
}

func targetNamespace(t *api.Target) string {
	if t == nil {
		return ""
	}
	return t.Namespace
}

// ended reports whether the operation's end is recorded (or it was
// recovered from the journal, finished).
func (o *op) ended() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.data.Done()
}

// timedOut reports whether the operation's deadline has passed.
func (o *op) timedOut() bool {
	var t *opTimeout
	return errors.As(context.Cause(o.ctx), &t)
}

// opTimeout is the cause of an operation's context when its deadline passes.
type opTimeout struct{ after time.Duration }

func (e *opTimeout) Error() string {
	return fmt.Sprintf("the operation did not finish within the agent's --operation-timeout of %v", e.after)
}

// snapshot returns a copy of the operation's document.
func (o *op) snapshot() api.Operation {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.data
}

// update changes the document under the lock and returns the new copy.
func (o *op) update(f func(*api.Operation)) api.Operation {
	o.mu.Lock()
	defer o.mu.Unlock()
	f(&o.data)
	o.data.Updated = time.Now().UTC()
	return o.data
}

// table holds the operations the agent knows: at most one active per VM,
// and a bounded history of finished ones.
type table struct {
	mu      sync.Mutex
	byID    map[string]*op
	active  map[string]*op // by VM key
	order   []string       // ids, oldest first
	removed map[string]error
	gone    []string // ids in removed, oldest first
	wg      sync.WaitGroup
}

// historyLimit bounds the finished operations kept, and removedLimit the
// reasons kept for operations forgotten because their VM went away: each
// a pod's container, so a tenant that creates and deletes pods must not
// grow the agent's memory by it.
const (
	historyLimit = 256
	removedLimit = 1024
)

func newTable() *table {
	return &table{byID: map[string]*op{}, active: map[string]*op{}, removed: map[string]error{}}
}

// add registers an operation as the VM's active one, or fails with BUSY.
func (t *table) add(o *op) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if cur, ok := t.active[o.key]; ok {
		return errcode.New(errcode.Busy, "VM %s already has a %s running (operation %s): wait for it or cancel it", o.key, cur.data.Kind, cur.id)
	}
	t.active[o.key] = o
	t.insert(o)
	t.wg.Add(1)
	return nil
}

// addFinished records an operation that ended elsewhere (recovered from the journal).
func (t *table) addFinished(d *api.Operation) {
	t.mu.Lock()
	defer t.mu.Unlock()
	o := &op{id: d.ID, key: vmKey(d.VM.PodUID, d.VM.Container), data: *d, done: make(chan struct{})}
	close(o.done)
	t.insert(o)
}

func (t *table) insert(o *op) {
	t.byID[o.id] = o
	t.order = append(t.order, o.id)
	// Forget the oldest finished operations beyond the history limit.
	for len(t.order) > historyLimit {
		oldest := t.byID[t.order[0]]
		if oldest != nil && t.active[oldest.key] == oldest {
			break
		}
		delete(t.byID, t.order[0])
		t.order = t.order[1:]
	}
}

// release frees the VM for its next operation. It is called before an
// operation's end is recorded, so that a caller who sees the end can start
// the next operation at once (not BUSY); finish releases too.
func (t *table) release(o *op) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.active[o.key] == o {
		delete(t.active, o.key)
	}
}

// finish marks an operation's end: the VM is free for the next one.
func (t *table) finish(o *op) {
	t.release(o)
	close(o.done)
	t.wg.Done()
}

// remove forgets an operation; asking for it later gets why.
func (t *table) remove(o *op, why error) {
	ns := namespaceOf(o.snapshot())
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.byID, o.id)
	t.order = slices.DeleteFunc(t.order, func(id string) bool { return id == o.id })
	if _, ok := t.removed[o.id]; !ok {
		t.gone = append(t.gone, o.id)
	}
	t.removed[o.id] = &forgotten{error: why, ns: ns}
	for len(t.gone) > removedLimit {
		delete(t.removed, t.gone[0])
		t.gone = t.gone[1:]
	}
}

// forgotten is the answer about a removed operation: why, and the
// namespace of its VM (who may hear why).
type forgotten struct {
	error
	ns string
}

func (f *forgotten) Unwrap() error { return f.error }

// namespaceOf is the namespace an operation acts in ("" if unknown).
func namespaceOf(d api.Operation) string { return d.Namespace }

func (t *table) get(id string) (*op, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if o, ok := t.byID[id]; ok {
		return o, nil
	}
	if why, ok := t.removed[id]; ok {
		return nil, why
	}
	return nil, noOperation(id)
}

// list returns the operations visible passes, oldest first.
func (t *table) list(visible func(api.Operation) bool) []api.Operation {
	t.mu.Lock()
	ops := make([]*op, 0, len(t.order))
	for _, id := range t.order {
		ops = append(ops, t.byID[id])
	}
	t.mu.Unlock()
	out := make([]api.Operation, 0, len(ops))
	for _, o := range ops {
		if d := o.snapshot(); visible(d) {
			out = append(out, d)
		}
	}
	return out
}

// forVM returns the operations (active or finished) of the VM in g.
func (t *table) forVM(g Gone) []*op {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []*op
	for _, id := range t.order {
		o := t.byID[id]
		d := &o.data
		if d.VM.PodUID != g.PodUID || d.VM.Container != g.Container {
			continue
		}
		// A replaced container is another VM: only its own operations go.
		if g.ContainerID != "" && d.Target != nil && d.Target.ContainerID != "" && d.Target.ContainerID != g.ContainerID {
			continue
		}
		out = append(out, o)
	}
	return out
}

func (t *table) cancelAll(why error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, o := range t.active {
		if o.cancel != nil {
			o.cancel(why)
		}
	}
}

// wait waits for running operations to end, or for ctx.
func (t *table) wait(ctx context.Context) {
	done := make(chan struct{})
	go func() { t.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
	}
}
