//go:build linux

package agent

// A crowd of status clients while a checkpoint runs. The test asserts what
// load cannot break: every status request is answered, correctly, every
// client's at least once while the checkpoint is held in the middle of its
// stream (so none was blocked behind it); the checkpoint completes and its
// image restores byte for byte. How much the
// crowd slows the checkpoint down depends on the machine and what else it
// runs, so it is measured by BenchmarkAgentCheckpointUnderStatusLoad
// (make bench), never asserted.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

const (
	statusClients   = 100
	statusPollEvery = 20 * time.Millisecond
)

// crowdStats is what the status clients saw.
type crowdStats struct {
	served, failed atomic.Int64
	clients        atomic.Int64 // clients answered at least once
	slowest        atomic.Int64 // nanoseconds
	firstErr       atomic.Value
}

func (s *crowdStats) fail(err error) {
	s.failed.Add(1)
	s.firstErr.CompareAndSwap(nil, err.Error())
}

// startCrowd starts clients that each ask, every statusPollEvery, for the
// operation list, the operation id and the metrics, checking each answer,
// until stop is called.
func startCrowd(tb testing.TB, a *testAgent, id string, clients int) (st *crowdStats, stop func()) {
	tb.Helper()
	st = &crowdStats{}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i := range clients {
		c, err := NewClient("unix://" + a.socket)
		if err != nil {
			tb.Fatal(err)
		}
		wg.Go(func() {
			paths := []string{"/v1/operations", "/v1/operations/" + id, "/metrics"}
			answered := false
			for j := i; ctx.Err() == nil; j++ {
				t0 := time.Now()
				err := askStatus(ctx, c, paths[j%len(paths)], id)
				took := time.Since(t0)
				for old := st.slowest.Load(); int64(took) > old && !st.slowest.CompareAndSwap(old, int64(took)); old = st.slowest.Load() {
				}
				switch {
				case ctx.Err() != nil:
				case err != nil:
					st.fail(err)
				default:
					st.served.Add(1)
					if !answered {
						answered = true
						st.clients.Add(1)
					}
				}
				select {
				case <-time.After(statusPollEvery):
				case <-ctx.Done():
				}
			}
		})
	}
	return st, func() { cancel(); wg.Wait() }
}

// askStatus asks for path and checks that the answer is about operation id.
func askStatus(ctx context.Context, c *Client, path, id string) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent"+path, nil)
	resp, err := c.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s %s", path, resp.Status, body)
	}
	var ok bool
	switch {
	case path == "/metrics":
		ok = strings.Contains(string(body), "vmsnap_operations_in_flight")
	case path == "/v1/operations":
		var doc struct{ Operations []api.Operation }
		ok = json.Unmarshal(body, &doc) == nil && slices.ContainsFunc(doc.Operations, func(o api.Operation) bool { return o.ID == id })
	default:
		var o api.Operation
		ok = json.Unmarshal(body, &o) == nil && o.ID == id && o.Kind == api.KindCheckpoint &&
			slices.Contains([]string{api.StatePending, api.StateRunning, api.StateSucceeded}, o.State)
	}
	if !ok {
		return fmt.Errorf("GET %s: a wrong answer about operation %s: %.300s", path, id, body)
	}
	return nil
}

// statusLoadAgent is an agent with one VM of stateSize bytes of state.
func statusLoadAgent(tb testing.TB, stateSize int) (*testAgent, []byte, *qmptest.FakeQEMU) {
	state := randomState(tb, stateSize)
	res := newStaticResolver()
	vm := qmptest.NewFakeQEMU(tb, "running", state)
	res.add(uid1, vm.Path())
	// The crowd is one caller (this process) with a connection each.
	return startAgentConfig(tb, Config{StateDir: tb.TempDir(), Resolver: res, MaxConcurrent: 2, Limits: Limits{Connections: 2 * statusClients}}), state, vm
}

// timedCheckpoint checkpoints the VM into a new layout, with during (if
// set) running from the operation's acceptance to its end, and returns how
// long it took and the operation's end.
func timedCheckpoint(tb testing.TB, a *testAgent, during func(id string) func()) (time.Duration, api.Operation) {
	tb.Helper()
	start := time.Now()
	op, err := a.client.Checkpoint(context.Background(), api.CheckpointRequest{
		VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/q"}, Image: "oci:" + tb.TempDir() + ":vm", Mode: "snapshot", Workers: 2,
	})
	if err != nil {
		tb.Fatal(err)
	}
	var end func()
	if during != nil {
		end = during(op.ID)
	}
	o := waitOp(tb, a.client, op.ID)
	d := time.Since(start)
	if end != nil {
		end()
	}
	if o.State != api.StateSucceeded {
		tb.Fatalf("checkpoint ended %s: %+v", o.State, o.Error)
	}
	return d, o
}

func TestAgentLoadStatusRequestsDoNotDisturbCheckpoint(t *testing.T) {
	stateSize := 48 * mib
	if testing.Short() {
		stateSize = 16 * mib
	}
	a, state, vm := statusLoadAgent(t, stateSize)
	held, release := make(chan struct{}), make(chan struct{})
	vm.MidStream = func() { close(held); <-release }
	// A guard against a hang only.
	guard, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var st *crowdStats
	busy, o := timedCheckpoint(t, a, func(id string) func() {
		var stop func()
		st, stop = startCrowd(t, a, id, statusClients)
		defer close(release)
		select {
		case <-held:
		case <-guard.Done():
			t.Fatal("the checkpoint never reached the middle of its stream")
		}
		// Every client is answered while the checkpoint is held: none waits
		// for it.
		for st.clients.Load() < statusClients && st.failed.Load() == 0 {
			select {
			case <-time.After(statusPollEvery):
			case <-guard.Done():
				t.Fatalf("%d of %d status clients answered while the checkpoint was held", st.clients.Load(), statusClients)
			}
		}
		return stop
	})
	slowest := time.Duration(st.slowest.Load())
	t.Logf("checkpoint of %d MiB with %d clients polling every %v: %v; %d status requests answered, the slowest in %v",
		stateSize/mib, statusClients, statusPollEvery, busy.Round(time.Millisecond), st.served.Load(), slowest.Round(time.Millisecond))
	if f := st.failed.Load(); f > 0 {
		t.Fatalf("%d status requests failed or were answered wrongly, first: %v", f, st.firstErr.Load())
	}

	// The checkpoint taken under load is whole: it restores byte for byte
	// (the fake QEMU fails a restore of anything but its state).
	if o.Checkpoint.VMState.RawBytes != int64(len(state)) {
		t.Fatalf("the checkpoint holds %d bytes, want %d", o.Checkpoint.VMState.RawBytes, len(state))
	}
	target := qmptest.NewFakeQEMU(t, "inmigrate", state)
	a.resolver.add(uid3, target.Path())
	rop, err := a.client.Restore(context.Background(), api.RestoreRequest{VM: api.VMRef{PodUID: uid3, Container: "qemu", QMPPath: "/q"}, Image: o.Checkpoint.VMState.Image})
	if err != nil {
		t.Fatal(err)
	}
	if r := waitOp(t, a.client, rop.ID); r.State != api.StateSucceeded {
		t.Fatalf("restoring the checkpoint taken under load: %s %+v", r.State, r.Error)
	}
	target.WaitMigrations()
	if target.Lock(); len(target.Received) != len(state) {
		t.Errorf("the restore fed %d bytes, want %d", len(target.Received), len(state))
	}
	target.Unlock()
}

// BenchmarkAgentCheckpointUnderStatusLoad measures how much a crowd of
// status clients (in this process, so competing for the same CPUs) slows a
// checkpoint: slowdown-x is the checkpoint's time with the crowd over its
// time without (the mean of one run before and one after).
func BenchmarkAgentCheckpointUnderStatusLoad(b *testing.B) {
	a, _, _ := statusLoadAgent(b, 48*mib)
	timedCheckpoint(b, a, nil) // warm up
	var quiet, busy, slowest time.Duration
	var served int64
	b.ResetTimer()
	for range b.N {
		q1, _ := timedCheckpoint(b, a, nil)
		var st *crowdStats
		d, _ := timedCheckpoint(b, a, func(id string) func() {
			var stop func()
			st, stop = startCrowd(b, a, id, statusClients)
			return stop
		})
		q2, _ := timedCheckpoint(b, a, nil)
		quiet += (q1 + q2) / 2
		busy += d
		served += st.served.Load()
		slowest = max(slowest, time.Duration(st.slowest.Load()))
		if f := st.failed.Load(); f > 0 {
			b.Fatalf("%d status requests failed, first: %v", f, st.firstErr.Load())
		}
	}
	b.ReportMetric(float64(busy)/float64(quiet), "slowdown-x")
	b.ReportMetric(float64(served)/busy.Seconds(), "status-req/s")
	b.ReportMetric(float64(slowest.Milliseconds()), "slowest-status-ms")
}
