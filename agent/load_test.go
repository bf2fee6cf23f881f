//go:build linux

package agent

// Load on one agent: many checkpoints at once stay within a memory bound
// that does not grow with the size of the VMs, --max-concurrent holds, and
// a crowd of status requests is answered while a checkpoint runs
// (load_status_test.go; how much it slows the checkpoint is a benchmark).
// The VMs are qmptest's fake QEMUs; the images go to OCI layouts.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"runtime"
	rtmetrics "runtime/metrics"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

func podUID(i int) string { return fmt.Sprintf("6f1c2a4e-%04d-4c0e-9a51-0123456789ab", i) }

// eventLog follows the agent's event stream and tracks how many operations
// run at once.
type eventLog struct {
	mu         sync.Mutex
	state      map[string]string
	running    int
	maxRunning int
	sawPending map[string]bool
	done       chan struct{}
	cancel     context.CancelFunc
}

func followEvents(t *testing.T, a *testAgent) *eventLog {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	l := &eventLog{state: map[string]string{}, sawPending: map[string]bool{}, done: make(chan struct{}), cancel: cancel}
	go func() {
		defer close(l.done)
		// The agent sends no headers before a first event (http.go does
		// not flush them): Do returns only then, so it runs here.
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent/v1/events", nil)
		resp, err := a.client.http.Do(req)
		if err != nil {
			return
		}
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 64<<10), 16<<20)
		for sc.Scan() {
			data, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			var ev api.Event
			if json.Unmarshal([]byte(data), &ev) != nil {
				continue
			}
			l.saw(ev.Operation)
		}
	}()
	t.Cleanup(l.stop)
	// Subscribed once the broker has us.
	deadline := time.Now().Add(5 * time.Second)
	for {
		a.srv.events.mu.Lock()
		n := len(a.srv.events.subs)
		a.srv.events.mu.Unlock()
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the event stream did not start")
		}
		time.Sleep(5 * time.Millisecond)
	}
	return l
}

func (l *eventLog) saw(o api.Operation) {
	l.mu.Lock()
	defer l.mu.Unlock()
	prev := l.state[o.ID]
	if prev == o.State {
		return // progress
	}
	if prev == api.StateRunning {
		l.running--
	}
	if o.State == api.StateRunning {
		l.running++
		l.maxRunning = max(l.maxRunning, l.running)
	}
	if o.State == api.StatePending {
		l.sawPending[o.ID] = true
	}
	l.state[o.ID] = o.State
}

func (l *eventLog) stop() {
	l.cancel()
	<-l.done
}

// memSampler records the peak of the live heap (as of each GC's mark) and
// of the heap's objects while a load runs.
type memSampler struct {
	stop     chan struct{}
	done     chan struct{}
	peakLive atomic.Uint64
	peakObjs atomic.Uint64
}

func sampleMemory() *memSampler {
	m := &memSampler{stop: make(chan struct{}), done: make(chan struct{})}
	samples := []rtmetrics.Sample{{Name: "/gc/heap/live:bytes"}, {Name: "/memory/classes/heap/objects:bytes"}}
	go func() {
		defer close(m.done)
		for {
			rtmetrics.Read(samples)
			if v := samples[0].Value.Uint64(); v > m.peakLive.Load() {
				m.peakLive.Store(v)
			}
			if v := samples[1].Value.Uint64(); v > m.peakObjs.Load() {
				m.peakObjs.Store(v)
			}
			select {
			case <-m.stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()
	return m
}

func (m *memSampler) finish() { close(m.stop); <-m.done }

func liveHeap() uint64 {
	runtime.GC()
	s := []rtmetrics.Sample{{Name: "/gc/heap/live:bytes"}}
	rtmetrics.Read(s)
	return s[0].Value.Uint64()
}

// vmHWM reads the process's peak RSS; resetPeakRSS restarts it (root, or
// our own process: /proc/self/clear_refs).
func vmHWM(t *testing.T) uint64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, _ := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}

func resetPeakRSS() bool { return os.WriteFile("/proc/self/clear_refs", []byte("5"), 0) == nil }

const mib = 1 << 20

// Eight checkpoints of eight VMs at once through one agent: all succeed,
// and the memory they take together is bounded by their chunk pipelines,
// not by the VMs' sizes: three times bigger VMs take about as much. All
// eight are held in the middle of their streams until each is there, so
// that both sizes run eight pipelines at once whatever the machine's load.
func TestAgentLoadEightConcurrentCheckpointsBoundedMemory(t *testing.T) {
	// The small states are large enough for every pipeline to fill its
	// buffer pools (they are made on first use), so what differs is only
	// how much state there is.
	small := runEightCheckpoints(t, 24*mib)
	big := runEightCheckpoints(t, 72*mib)
	// Buffering the state would take 3x as much for the big VMs.
	if big > 2*small {
		t.Fatalf("peak live heap +%d MiB for 8 x 64 MiB VMs, +%d MiB for 8 x 16 MiB: memory follows the VMs' size", big/mib, small/mib)
	}
}

func runEightCheckpoints(t *testing.T, stateSize int) int64 {
	const (
		vms       = 8
		workers   = 2
		chunkSize = 1 * mib
	)
	// One state for all: the fakes only read it, and the test's own heap
	// stays small next to what the checkpoints stream (vms x stateSize).
	state := randomState(t, stateSize)
	res := newStaticResolver()
	var midway sync.WaitGroup
	midway.Add(vms)
	release := make(chan struct{})
	for i := range vms {
		vm := qmptest.NewFakeQEMU(t, "running", state)
		vm.MidStream = func() { midway.Done(); <-release }
		res.add(podUID(i), vm.Path())
	}
	a := startAgent(t, t.TempDir(), res, vms)
	defer a.stop()
	ev := followEvents(t, a)
	stores := make([]string, vms)
	for i := range stores {
		stores[i] = t.TempDir() // a layout each: no chunk is shared
	}

	base := liveHeap()
	rssReset := resetPeakRSS()
	rssBase := vmHWM(t)
	mem := sampleMemory()
	start := time.Now()
	ids := make([]string, vms)
	for i := range vms {
		op, err := a.client.Checkpoint(context.Background(), api.CheckpointRequest{
			VM: api.VMRef{PodUID: podUID(i), Container: "qemu", QMPPath: "/run/vm/qmp.sock"}, Image: "oci:" + stores[i] + ":vm",
			Mode: "snapshot", ChunkSize: chunkSize, Workers: workers,
		})
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = op.ID
	}
	waitMidway(t, &midway, ids, a)
	close(release)
	var raw int64
	for _, id := range ids {
		o := waitOp(t, a.client, id)
		if o.State != api.StateSucceeded {
			t.Fatalf("checkpoint %s ended %s: %+v", id, o.State, o.Error)
		}
		raw += o.Checkpoint.VMState.RawBytes
	}
	elapsed := time.Since(start)
	mem.finish()
	rssPeak := vmHWM(t)
	ev.stop()

	if raw != int64(vms*stateSize) {
		t.Fatalf("streamed %d raw bytes, want %d", raw, vms*stateSize)
	}
	if ev.maxRunning != vms {
		t.Fatalf("%d checkpoints ran at once, want all %d", ev.maxRunning, vms)
	}
	live := int64(mem.peakLive.Load()) - int64(base)
	objs := int64(mem.peakObjs.Load()) - int64(base)
	// Per checkpoint: what its chunk pipeline may hold, plus slack for the
	// agent, the fakes' pipes and the runtime.
	bound := int64(vms)*chunk.StreamOptions{ChunkSize: chunkSize, Workers: workers}.EncodeMemory() + 64*mib
	t.Logf("%d checkpoints of %d MiB at once (at most %d running): %d MiB streamed in %v; peak live heap +%d MiB, peak heap objects +%d MiB (GC garbage included), peak RSS %d MiB -> %d MiB (reset: %v); bound on live heap %d MiB",
		vms, stateSize/mib, ev.maxRunning, raw/mib, elapsed.Round(time.Millisecond), live/mib, objs/mib, rssBase/mib, rssPeak/mib, rssReset, bound/mib)
	if live > bound {
		t.Fatalf("peak live heap grew by %d MiB with %d checkpoints at once, want < %d MiB", live/mib, vms, bound/mib)
	}
	return live
}

// waitMidway waits until every checkpoint's fake QEMU is in the middle of
// its stream, or fails if one ends first or the hang guard expires.
func waitMidway(t *testing.T, midway *sync.WaitGroup, ids []string, a *testAgent) {
	t.Helper()
	all := make(chan struct{})
	go func() { midway.Wait(); close(all) }()
	select {
	case <-all:
	case <-time.After(5 * time.Minute): // a guard against a hang only
		list, _ := a.client.List(context.Background())
		t.Fatalf("not every checkpoint of %v reached the middle of its stream: %+v", ids, list)
	}
}

// --max-concurrent: of eight checkpoints, at most N run at once; the rest
// wait as pending and run as slots free up.
func TestAgentLoadMaxConcurrentHolds(t *testing.T) {
	const (
		vms = 8
		n   = 3
	)
	state := randomState(t, 8*mib)
	res := newStaticResolver()
	for i := range vms {
		res.add(podUID(i), qmptest.NewFakeQEMU(t, "running", state).Path())
	}
	a := startAgent(t, t.TempDir(), res, n)
	ev := followEvents(t, a)
	// Hold every slot so that all eight queue up first.
	for range n {
		a.srv.slots <- struct{}{}
	}
	ids := make([]string, vms)
	for i := range vms {
		op, err := a.client.Checkpoint(context.Background(), api.CheckpointRequest{
			VM: api.VMRef{PodUID: podUID(i), Container: "qemu", QMPPath: "/q"}, Image: "oci:" + t.TempDir() + ":vm", Workers: 2,
		})
		if err != nil {
			t.Fatal(err)
		}
		if op.State != api.StatePending {
			t.Fatalf("checkpoint %d is %s with every slot taken, want pending", i, op.State)
		}
		ids[i] = op.ID
	}
	list, err := a.client.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	pending := 0
	for _, o := range list {
		if o.State == api.StatePending {
			pending++
		}
	}
	if pending != vms {
		t.Fatalf("%d of %d pending while every slot is held", pending, vms)
	}
	if body := get(t, a, "/metrics"); !strings.Contains(body, `vmsnap_operations_in_flight{kind="checkpoint",state="pending"} 8`) {
		t.Errorf("metrics do not show 8 pending")
	}
	for range n {
		<-a.srv.slots
	}
	for _, id := range ids {
		if o := waitOp(t, a.client, id); o.State != api.StateSucceeded {
			t.Fatalf("checkpoint %s ended %s: %+v", id, o.State, o.Error)
		}
	}
	time.Sleep(50 * time.Millisecond)
	ev.stop()
	ev.mu.Lock()
	defer ev.mu.Unlock()
	if ev.maxRunning != n {
		t.Fatalf("at most %d ran at once, want exactly --max-concurrent %d", ev.maxRunning, n)
	}
	for _, id := range ids {
		if !ev.sawPending[id] || ev.state[id] != api.StateSucceeded {
			t.Fatalf("events of %s: pending seen %v, last %s", id, ev.sawPending[id], ev.state[id])
		}
	}
	t.Logf("%d checkpoints with --max-concurrent %d: all pending first, at most %d running at once (from the event stream)", vms, n, ev.maxRunning)
}
