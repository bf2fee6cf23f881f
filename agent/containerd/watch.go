package containerd

import (
	"context"
	"fmt"
	"time"

	apievents "github.com/containerd/containerd/api/events"
	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	tasktypes "github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/core/events"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// The containerd event topics Watch listens to. A container is gone when
// its main process exits (/tasks/exit; the kubelet never restarts a task in
// place: a restart is a new container) or when it is deleted
// (/containers/delete). /tasks/delete repeats an exit that may have been
// missed; /tasks/start marks a container as alive again; /containers/create
// lets the watcher learn the labels of a new container while it can still
// be asked, and tells that a pod's container was replaced.
var watchTopics = []string{"/containers/create", "/containers/delete", "/tasks/start", "/tasks/exit", "/tasks/delete"}

// Watch reports, on the returned channel, each container of a pod that is
// deleted, whose main process exits, or that is superseded by a newer
// container of the same pod and name: once per container. It covers every
// container the kubelet labelled with a pod UID and a container name, not
// only those Resolve returned, so that records that outlived an agent
// restart are dropped too; containers that had already stopped when Watch
// started are reported only if Resolve had returned them.
//
// Events that happen after Watch returns are not missed: the subscription
// is in place before it returns. If the event stream fails later (containerd
// restarted), Watch subscribes again with a backoff and then compares
// containerd's containers and tasks with what it knew, reporting what
// disappeared or stopped in between.
//
// The channel is closed when ctx ends; until then the watcher queues what
// the caller has not read yet, and never blocks containerd's stream. Watch
// fails (INTERNAL) only if containerd does not answer when it is called.
// Each call is an independent subscription.
func (r *Resolver) Watch(ctx context.Context) (<-chan agent.Gone, error) {
	ctx = namespaces.WithNamespace(ctx, r.namespace)
	w := &watcher{r: r, out: make(chan agent.Gone), state: map[string]*watched{}, first: true}
	s, err := w.open(ctx)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "watching containerd's events")
	}
	go w.run(ctx, s)
	return w.out, nil
}

type watched struct {
	gone     agent.Gone
	reported bool // a Gone was queued; cleared when a task starts again
}

type watcher struct {
	r     *Resolver
	out   chan agent.Gone
	queue []agent.Gone
	// state holds every pod container the watcher knows of, by ID, until it
	// is deleted.
	state map[string]*watched
	first bool // the next reconcile is the first one
}

type subscription struct {
	events <-chan *events.Envelope
	errs   <-chan error
	cancel context.CancelFunc
}

// open subscribes, then reconciles: an event after the list is in the
// stream, a change before it is in the list.
func (w *watcher) open(ctx context.Context) (*subscription, error) {
	sctx, cancel := context.WithCancel(ctx)
	filters := make([]string, len(watchTopics))
	for i, t := range watchTopics {
		filters[i] = fmt.Sprintf("namespace==%q,topic==%q", w.r.namespace, t)
	}
	evs, errs := w.r.client.Subscribe(sctx, filters...)
	rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
	defer rcancel()
	if err := w.reconcile(rctx); err != nil {
		cancel()
		return nil, err
	}
	// A subscription that failed at once has its error waiting.
	select {
	case err := <-errs:
		cancel()
		if err == nil {
			err = ctx.Err()
		}
		return nil, err
	default:
	}
	return &subscription{events: evs, errs: errs, cancel: cancel}, nil
}

func (w *watcher) run(ctx context.Context, s *subscription) {
	defer close(w.out) // the agent subscribes again
	defer func() {
		if v := recover(); v != nil {
			_ = agent.Recovered(w.r.log, v, "the containerd watch")
		}
	}()
	delay := 100 * time.Millisecond
	for {
		err := w.serve(ctx, s)
		s.cancel()
		if ctx.Err() != nil {
			return
		}
		w.r.log.Warn("containerd event stream failed; subscribing again", "namespace", w.r.namespace, "err", err)
		for {
			if !w.sleep(ctx, delay) {
				return
			}
			delay = min(delay*2, w.r.retryMax)
			if s, err = w.open(ctx); err == nil {
				delay = 100 * time.Millisecond
				break
			}
			if ctx.Err() != nil {
				return
			}
			w.r.log.Warn("containerd events: subscribing again failed", "namespace", w.r.namespace, "err", err, "retry_in", delay)
		}
	}
}

// serve handles s's events and delivers the queue until the stream fails
// or ctx ends.
func (w *watcher) serve(ctx context.Context, s *subscription) error {
	for {
		out, next := w.head()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-s.errs:
			if err == nil {
				err = fmt.Errorf("event stream closed")
			}
			return err
		case e := <-s.events:
			w.handle(ctx, e)
		case out <- next:
			w.queue = w.queue[1:]
		}
	}
}

// sleep waits for d while delivering the queue; false if ctx ended.
func (w *watcher) sleep(ctx context.Context, d time.Duration) bool {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		out, next := w.head()
		select {
		case <-ctx.Done():
			return false
		case <-timer.C:
			return true
		case out <- next:
			w.queue = w.queue[1:]
		}
	}
}

// head is the channel to send the queue's head on: nil when it is empty.
func (w *watcher) head() (chan<- agent.Gone, agent.Gone) {
	if len(w.queue) == 0 {
		return nil, agent.Gone{}
	}
	return w.out, w.queue[0]
}

func (w *watcher) handle(ctx context.Context, e *events.Envelope) {
	if e == nil || e.Namespace != w.r.namespace || e.Event == nil {
		return
	}
	v, err := typeurl.UnmarshalAny(e.Event)
	if err != nil {
		w.r.log.Warn("containerd events: cannot decode", "topic", e.Topic, "err", err)
		return
	}
	switch ev := v.(type) {
	case *apievents.ContainerCreate:
		w.created(ctx, ev.ID)
	case *apievents.TaskStart:
		if st := w.state[ev.ContainerID]; st != nil {
			st.reported = false
		} else {
			w.created(ctx, ev.ContainerID)
		}
	case *apievents.TaskExit:
		if ev.ID == ev.ContainerID { // the main process, not an exec
			w.gone(ctx, ev.ContainerID, fmt.Sprintf("its main process exited with status %d", ev.ExitStatus))
		}
	case *apievents.TaskDelete:
		if ev.ID == "" || ev.ID == ev.ContainerID {
			w.gone(ctx, ev.ContainerID, "its task was deleted")
		}
	case *apievents.ContainerDelete:
		w.gone(ctx, ev.ID, "it was deleted")
		w.forget(ev.ID)
	}
}

// created learns a new container's identity while it can still be asked
// for, and reports older containers of the same pod and name as replaced.
func (w *watcher) created(ctx context.Context, id string) {
	g, ok := w.lookup(ctx, id)
	if !ok {
		return
	}
	if _, seen := w.state[id]; !seen {
		w.state[id] = &watched{gone: g}
	}
	for oid, st := range w.state {
		if oid != id && st.gone.PodUID == g.PodUID && st.gone.Container == g.Container {
			w.report(st, "it was replaced by container "+shortID(id))
		}
	}
}

// gone reports container id, if it is a pod's container and was not
// reported already.
func (w *watcher) gone(ctx context.Context, id, why string) {
	st := w.state[id]
	if st == nil {
		g, ok := w.r.knownGone(id)
		if !ok {
			// Not deleted yet (an exit): its labels can still be read.
			if g, ok = w.lookup(ctx, id); !ok {
				return
			}
		}
		st = &watched{gone: g}
		w.state[id] = st
	}
	w.report(st, why)
}

func (w *watcher) report(st *watched, why string) {
	if st.reported {
		return
	}
	st.reported = true
	w.r.log.Debug("container gone", "pod_uid", st.gone.PodUID, "container", st.gone.Container, "container_id", st.gone.ContainerID, "why", why)
	w.queue = append(w.queue, st.gone)
}

func (w *watcher) forget(id string) {
	delete(w.state, id)
	w.r.mu.Lock()
	delete(w.r.known, id)
	w.r.mu.Unlock()
}

// lookup reads a container's labels: ok is false if it is not a pod's
// container (or no longer exists).
func (w *watcher) lookup(ctx context.Context, id string) (agent.Gone, bool) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	c, err := w.r.client.ContainerService().Get(ctx, id)
	if err != nil {
		if !errdefs.IsNotFound(err) {
			w.r.log.Warn("containerd events: cannot read container", "container_id", id, "err", err)
		}
		return agent.Gone{}, false
	}
	return identity(c)
}

// identity is the Gone of a pod's container; ok is false for other
// containers and for pod sandboxes.
func identity(c containers.Container) (agent.Gone, bool) {
	uid, name := c.Labels[LabelPodUID], c.Labels[LabelContainerName]
	if uid == "" || name == "" || c.Labels[LabelKind] == "sandbox" {
		return agent.Gone{}, false
	}
	return agent.Gone{PodUID: uid, Container: name, ContainerID: c.ID}, true
}

// reconcile compares containerd's containers and tasks with the watcher's
// state: what disappeared or stopped is reported. On the first reconcile,
// containers that are already stopped are reported only if Resolve
// returned them (the kubelet keeps exited containers around; they are no
// news).
func (w *watcher) reconcile(ctx context.Context) error {
	list, err := w.r.client.ContainerService().List(ctx, fmt.Sprintf("labels.%q", LabelPodUID))
	if err != nil {
		return fmt.Errorf("listing containers: %w", err)
	}
	resp, err := w.r.client.TaskService().List(ctx, &tasksapi.ListTasksRequest{})
	if err != nil {
		return fmt.Errorf("listing tasks: %w", err)
	}
	alive := map[string]bool{}
	for _, t := range resp.GetTasks() {
		switch t.GetStatus() {
		case tasktypes.Status_RUNNING, tasktypes.Status_PAUSED, tasktypes.Status_PAUSING:
			alive[t.GetID()] = true
		}
	}
	w.r.mu.Lock()
	known := make(map[string]agent.Gone, len(w.r.known))
	for id, g := range w.r.known {
		known[id] = g
	}
	w.r.mu.Unlock()

	present := map[string]bool{}
	for _, c := range list {
		g, ok := identity(c)
		if !ok {
			continue
		}
		present[c.ID] = true
		st := w.state[c.ID]
		if st == nil {
			st = &watched{gone: g}
			w.state[c.ID] = st
			if !alive[c.ID] {
				if _, resolved := known[c.ID]; w.first && !resolved {
					st.reported = true // already stopped: no news
				}
			}
		}
		if alive[c.ID] {
			st.reported = false
		} else {
			w.report(st, "its task is not running")
		}
	}
	for id, st := range w.state {
		if !present[id] {
			w.report(st, "it was deleted")
			w.forget(id)
			present[id] = true // handled
		}
	}
	for id, g := range known {
		if !present[id] {
			w.report(&watched{gone: g}, "it was deleted")
			w.forget(id)
		}
	}
	w.first = false
	return nil
}

// knownGone is the identity Resolve recorded for container id.
func (r *Resolver) knownGone(id string) (agent.Gone, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	g, ok := r.known[id]
	return g, ok
}
