package containerd

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/cio"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/internal/errcode"
	testcontainerd "github.com/vmsnap/vmsnap/internal/testing/containerd"
)

var nullIO = cio.NullIO

func watch(t *testing.T, r *Resolver) (<-chan agent.Gone, context.CancelFunc) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ch, err := r.Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return ch, cancel
}

// nextGone waits for a Gone for container id, failing on any other. It
// waits as long as it takes (the test's -timeout ends a watch that never
// reports): how soon a Gone comes is a benchmark's question, not a test's.
func nextGone(t *testing.T, ch <-chan agent.Gone, want agent.Gone) {
	t.Helper()
	g, ok := <-ch
	if !ok {
		t.Fatal("watch channel closed")
	}
	if g != want {
		t.Fatalf("got %+v, want %+v", g, want)
	}
}

// quiet fails if anything arrives on ch for d.
func quiet(t *testing.T, ch <-chan agent.Gone, d time.Duration, what string) {
	t.Helper()
	select {
	case g, ok := <-ch:
		t.Fatalf("%s: unexpected %+v (open %v)", what, g, ok)
	case <-time.After(d):
	}
}

func gone(uid string, c *testcontainerd.Container) agent.Gone {
	return agent.Gone{PodUID: uid, Container: "qemu", ContainerID: c.ID}
}

func TestWatchDelete(t *testing.T) {
	e := newEnv(t)
	if _, _, err := resolve(t, e.r, e.ref()); err != nil {
		t.Fatal(err)
	}
	ch, _ := watch(t, e.r)
	quiet(t, ch, 300*time.Millisecond, "nothing happened yet")

	// An exec'd process exiting is not the VM going away.
	execIn(t, e, e.c, "/bin/busybox", "true")
	quiet(t, ch, 300*time.Millisecond, "after an exec exited")

	t0 := time.Now()
	e.d.Delete(t, e.c)
	deleted := time.Since(t0)
	nextGone(t, ch, gone(e.uid, e.c))
	t.Logf("Gone %v after the deletion started (the deletion took %v)", time.Since(t0), deleted)
	// Once per container, although exit, task delete and container delete
	// all arrive.
	quiet(t, ch, 500*time.Millisecond, "after the Gone")

	_, _, err := resolve(t, e.r, e.ref())
	wantCode(t, "deleted container", err, errcode.VMNotFound, "no pod")
}

func TestWatchReplace(t *testing.T) {
	e := newEnv(t)
	tg, _, err := resolve(t, e.r, e.ref())
	if err != nil {
		t.Fatal(err)
	}
	ch, _ := watch(t, e.r)
	n := e.d.Replace(t, e.c)
	nextGone(t, ch, gone(e.uid, e.c))
	quiet(t, ch, 300*time.Millisecond, "after the replacement")
	tg2, _, err := resolve(t, e.r, e.ref())
	if err != nil {
		t.Fatal(err)
	}
	if tg2.ContainerID != n.ID || tg2.ContainerID == tg.ContainerID || tg2.QMPPath != tg.QMPPath {
		t.Fatalf("after replace: %+v; want container %s and the same socket %s", tg2, n.ID, tg.QMPPath)
	}
	// The replacement is watched too, although Resolve saw it after Watch
	// started.
	e.d.Delete(t, n)
	nextGone(t, ch, gone(e.uid, n))
}

// TestWatchExitAndSupersede: a VM whose main process dies is gone even if
// its container stays; a container the kubelet creates next to a running
// one supersedes it.
func TestWatchExitAndSupersede(t *testing.T) {
	e := newEnv(t)
	ch, _ := watch(t, e.r)
	// Not resolved by this Resolver (as after an agent restart): still
	// reported, from the labels read at watch time.
	e.d.Kill(t, e.c)
	nextGone(t, ch, gone(e.uid, e.c))

	second := e.d.Create(t, testcontainerd.PodContainer{PodUID: e.uid, Name: "qemu", HostDir: e.c.HostDir})
	quiet(t, ch, 300*time.Millisecond, "a restart's new container (the old one was reported)")
	third := e.d.Create(t, testcontainerd.PodContainer{PodUID: e.uid, Name: "qemu", HostDir: e.c.HostDir})
	nextGone(t, ch, gone(e.uid, second))
	// Other containers of the pod and other pods are not touched.
	side := e.d.Create(t, testcontainerd.PodContainer{PodUID: e.uid, Name: "sidecar", HostDir: "-"})
	otherUID := testcontainerd.NewPodUID()
	e.d.Create(t, testcontainerd.PodContainer{PodUID: otherUID, Name: "qemu", HostDir: "-"})
	quiet(t, ch, 300*time.Millisecond, "other containers created")
	e.d.Delete(t, side)
	nextGone(t, ch, agent.Gone{PodUID: e.uid, Container: "sidecar", ContainerID: side.ID})
	e.d.Delete(t, third)
	nextGone(t, ch, gone(e.uid, third))
}

// TestWatchReconnect restarts containerd: the watcher subscribes again and
// reports what happened while containerd was down.
func TestWatchReconnect(t *testing.T) {
	e := newEnv(t)
	if _, _, err := resolve(t, e.r, e.ref()); err != nil {
		t.Fatal(err)
	}
	ch, _ := watch(t, e.r)
	pid := e.c.Task.Pid()
	t0 := time.Now()
	// The VM dies while containerd is down: its exit event may never come.
	e.d.Restart(t, func() {
		if err := syscall.Kill(int(pid), syscall.SIGKILL); err != nil {
			t.Error(err)
		}
		time.Sleep(200 * time.Millisecond)
	})
	up := time.Since(t0)
	nextGone(t, ch, gone(e.uid, e.c))
	t.Logf("containerd restarted in %v; Gone %v after the restart began", up, time.Since(t0))

	// And the stream works again.
	other := e.d.Create(t, testcontainerd.PodContainer{PodUID: e.uid, Name: "qemu", HostDir: e.c.HostDir})
	if tg, _, err := resolve(t, e.r, e.ref()); err != nil || tg.ContainerID != other.ID {
		t.Fatalf("after restart: %+v, %v", tg, err)
	}
	e.d.Delete(t, other)
	nextGone(t, ch, gone(e.uid, other))
}

// TestWatchStops: the channel closes when the context ends, also with
// reports nobody read, and also while containerd is down.
func TestWatchStops(t *testing.T) {
	e := newEnv(t)
	if _, _, err := resolve(t, e.r, e.ref()); err != nil {
		t.Fatal(err)
	}
	ch, cancel := watch(t, e.r)
	e.d.Delete(t, e.c)
	time.Sleep(300 * time.Millisecond) // the Gone is queued, unread
	cancel()
	closed(t, ch)

	// Gone before Watch started: reported at once, from what Resolve saw.
	e2 := e.d.Create(t, testcontainerd.PodContainer{PodUID: e.uid, Name: "qemu", HostDir: e.c.HostDir})
	if _, _, err := resolve(t, e.r, e.ref()); err != nil {
		t.Fatal(err)
	}
	e.d.Delete(t, e2)
	ch, cancel = watch(t, e.r)
	nextGone(t, ch, gone(e.uid, e2))

	// Cancelled while containerd is down and the watcher retries.
	e.d.Restart(t, func() {
		time.Sleep(300 * time.Millisecond)
		cancel()
		closed(t, ch)
	})
}

func closed(t *testing.T, ch <-chan agent.Gone) {
	t.Helper()
	deadline := time.After(2 * time.Second)
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				return
			}
		case <-deadline:
			t.Fatal("watch channel not closed 2s after its context ended")
		}
	}
}

// TestReconcile checks what a (re)subscription learns from containerd's
// lists: pod containers only, not sandboxes, and which are stopped.
func TestReconcile(t *testing.T) {
	e := newEnv(t)
	sandbox := e.d.Create(t, testcontainerd.PodContainer{PodUID: e.uid, Name: "qemu", HostDir: "-",
		Labels: map[string]string{testcontainerd.LabelKind: "sandbox"}})
	stopped := e.d.Create(t, testcontainerd.PodContainer{PodUID: e.uid, Name: "old", HostDir: "-"})
	e.d.Kill(t, stopped)
	w := &watcher{r: e.r, out: make(chan agent.Gone), state: map[string]*watched{}, first: true}
	ctx := e.d.Context(context.Background())
	if err := w.reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if st := w.state[e.c.ID]; st == nil || st.reported || st.gone != gone(e.uid, e.c) {
		t.Errorf("running container: %+v", st)
	}
	if st := w.state[stopped.ID]; st == nil || !st.reported {
		t.Errorf("already stopped container: %+v; want known and not news", st)
	}
	if st := w.state[sandbox.ID]; st != nil {
		t.Errorf("sandbox in state: %+v", st)
	}
	if len(w.queue) != 0 {
		t.Errorf("first reconcile queued %v", w.queue)
	}
	// Later reconciles report what stopped or disappeared since.
	e.d.Kill(t, e.c)
	e.d.Delete(t, stopped)
	if err := w.reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if len(w.queue) != 1 || w.queue[0] != gone(e.uid, e.c) {
		t.Errorf("second reconcile queued %+v; want only %s", w.queue, e.c.ID)
	}
	if _, ok := w.state[stopped.ID]; ok {
		t.Errorf("deleted container still in state")
	}
}
