//go:build linux

package agent

// One caller floods the agent with event stream attempts: the test binary
// re-executes itself as the attacker (TestFloodChild), a process of its
// own that the agent places in namespace tenant-a, while this process, on
// the node, checkpoints a VM through the same agent.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/testing/streamflood"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

const (
	floodChildSocket = "VMSNAP_FLOOD_SOCKET"
	floodResultMark  = "FLOOD-RESULT: "
	floodAttempts    = 20000
	floodWorkers     = 64
	// floodHeapBound is what docs/security-model.md promises one caller at its
	// default limits can make the agent's live heap grow by, with the
	// other caller's small checkpoint running beside it.
	floodHeapBound = 16 << 20
)

// TestFloodChild is not a test: it is the attacker of
// TestAgentStreamFloodFromOneCaller, run in a child process
// (internal/testing/streamflood). It prints what it saw and holds its streams
// until its stdin closes.
func TestFloodChild(t *testing.T) {
	socket := os.Getenv(floodChildSocket)
	if socket == "" {
		t.Skip("helper process of TestAgentStreamFloodFromOneCaller: runs only as its child")
	}
	r, held := streamflood.Run(socket, floodAttempts, floodWorkers)
	b, _ := json.Marshal(r)
	fmt.Printf("%s%s\n", floodResultMark, b)
	_, _ = io.Copy(io.Discard, os.Stdin)
	for _, c := range held {
		c.Close()
	}
}

// placeOthersIn makes the agent place every process but this one in
// namespace ns, until the test ends.
func placeOthersIn(t *testing.T, ns string) {
	old := placePeer
	placePeer = func(s *Server, ctx context.Context, p peer, accepted time.Time) (Caller, error) {
		if p.pid != int32(os.Getpid()) {
			return Caller{Namespace: ns, Pod: "attacker", Container: "flood", PID: p.pid}, nil
		}
		return old(s, ctx, p, accepted)
	}
	t.Cleanup(func() { placePeer = old })
}

// One caller tries 20,000 event streams, 64 at a time, and keeps every one
// it gets. It gets as many as its limit, is refused the rest with BUSY
// (or, while the agent answers 32 refusals, a closed connection), and the
// agent's live heap grows by less than floodHeapBound; meanwhile another
// caller's checkpoint completes. Once the attacker is gone, the agent
// holds nothing of it.
func TestAgentStreamFloodFromOneCaller(t *testing.T) {
	placeOthersIn(t, "tenant-a")
	state := randomState(t, 1<<20)
	vm := qmptest.NewFakeQEMU(t, "running", state)
	res := newStaticResolver()
	res.add(uid1, vm.Path())
	a := startAgentConfig(t, Config{StateDir: t.TempDir(), Resolver: res})
	const attacker = "namespace tenant-a"

	base := liveHeap()
	mem := sampleMemory()
	child := exec.Command(os.Args[0], "-test.run=^TestFloodChild$")
	child.Env = append(os.Environ(), floodChildSocket+"="+a.socket)
	stdin, _ := child.StdinPipe()
	stdout, _ := child.StdoutPipe()
	child.Stderr = os.Stderr
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	defer child.Process.Kill()
	// Past a bound, the attack has succeeded: stop it at once, rather than
	// let it take this process's memory and descriptors.
	overrun := make(chan string, 1)
	stopWatch := watchFlood(a.srv, base, mem, attacker, func(why string) { overrun <- why; child.Process.Kill() })
	defer stopWatch()

	// The other caller (this process, on the node) checkpoints its VM
	// while the flood runs: once the attacker holds its streams.
	deadline := time.Now().Add(time.Minute)
	for a.srv.held.count(attacker, streams) < DefaultMaxStreamsPerCaller && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	op, err := a.client.Checkpoint(context.Background(), api.CheckpointRequest{VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/q"},
		Image: "oci:" + t.TempDir() + ":vm", Mode: "snapshot", Workers: 1, ChunkSize: 64 << 10})
	if err != nil {
		t.Fatalf("the other caller's checkpoint was refused: %v", err)
	}
	if final := waitOp(t, a.client, op.ID); final.State != api.StateSucceeded || final.Checkpoint.VMState.RawBytes != int64(len(state)) {
		t.Fatalf("the other caller's checkpoint: %s %+v", final.State, final.Error)
	}

	r, ok := floodOutcome(stdout)
	stopWatch()
	mem.finish()
	select {
	case why := <-overrun:
		t.Fatalf("the flood was stopped: %s", why)
	default:
	}
	if !ok {
		t.Fatal("the attacker printed no result")
	}
	grew := int64(mem.peakLive.Load()) - int64(base)
	t.Logf("attacker: %+v; holds %d connections, %d streams; live heap +%.1f MiB at its peak (bound %d MiB), heap objects peak %.1f MiB",
		r, a.srv.held.count(attacker, connections), a.srv.held.count(attacker, streams), float64(grew)/mib, floodHeapBound/mib, float64(mem.peakObjs.Load())/mib)
	if r.Streams != DefaultMaxStreamsPerCaller || r.Busy == 0 || len(r.Other) != 0 || r.Total() != floodAttempts {
		t.Errorf("the attacker got %+v; want exactly %d streams, the rest refused", r, DefaultMaxStreamsPerCaller)
	}
	if n := a.srv.held.count(attacker, streams); n != DefaultMaxStreamsPerCaller {
		t.Errorf("the agent counts %d streams of the attacker, who holds %d", n, r.Streams)
	}
	if n := a.srv.held.count(attacker, connections); n > DefaultMaxConnectionsPerCaller {
		t.Errorf("the attacker holds %d connections, over the limit %d", n, DefaultMaxConnectionsPerCaller)
	}
	if grew > floodHeapBound {
		t.Errorf("the agent's live heap grew by %d MiB under the flood, over %d MiB", grew/mib, floodHeapBound/mib)
	}

	stdin.Close()
	_ = child.Wait()
	deadline = time.Now().Add(30 * time.Second)
	for a.srv.held.count(attacker, connections)+a.srv.held.count(attacker, streams) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the attacker left; the agent still counts %d connections and %d streams of it",
				a.srv.held.count(attacker, connections), a.srv.held.count(attacker, streams))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// floodOutcome reads the attacker's result line; false if it printed none.
func floodOutcome(stdout io.Reader) (streamflood.Result, bool) {
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		if line, ok := strings.CutPrefix(sc.Text(), floodResultMark); ok {
			var r streamflood.Result
			return r, json.Unmarshal([]byte(line), &r) == nil
		}
	}
	return streamflood.Result{}, false
}

// watchFlood calls stop, once, if the attacker holds more streams or
// connections than its limits, or the live heap grows past floodHeapBound,
// until the returned function is called.
func watchFlood(s *Server, base uint64, mem *memSampler, attacker string, stop func(why string)) func() {
	done := make(chan struct{})
	var once sync.Once
	go func() {
		for {
			var why string
			switch n, c := s.held.count(attacker, streams), s.held.count(attacker, connections); {
			case n > DefaultMaxStreamsPerCaller:
				why = fmt.Sprintf("the attacker holds %d streams", n)
			case c > DefaultMaxConnectionsPerCaller:
				why = fmt.Sprintf("the attacker holds %d connections", c)
			case int64(mem.peakLive.Load())-int64(base) > floodHeapBound:
				why = fmt.Sprintf("the live heap grew by %d MiB", (int64(mem.peakLive.Load())-int64(base))/mib)
			}
			if why != "" {
				stop(why)
				return
			}
			select {
			case <-done:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	return func() { once.Do(func() { close(done) }) }
}
