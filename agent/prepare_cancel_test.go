package agent

import (
	"context"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// stallingRegistry is an in-process registry that, once armed, sends the
// first bytes of a large blob and then nothing until its request ends:
// a fetch stalled midway.
type stallingRegistry struct {
	host    string
	armed   chan struct{} // closed: stall the next large blob
	stalled chan struct{} // closed once a blob stalls
	once    sync.Once
}

// stallAfter is how much of a blob the registry sends before it stalls:
// more than a manifest or a device state, less than a RAM layer.
const stallAfter = 64 << 10

func startStallingRegistry(t *testing.T) *stallingRegistry {
	r := &stallingRegistry{armed: make(chan struct{}), stalled: make(chan struct{})}
	reg := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		select {
		case <-r.armed:
			if req.Method == http.MethodGet && strings.Contains(req.URL.Path, "/blobs/") {
				w = &stallingWriter{ResponseWriter: w, r: r, ctx: req.Context()}
			}
		default:
		}
		reg.ServeHTTP(w, req)
	}))
	t.Cleanup(srv.Close)
	r.host = strings.TrimPrefix(srv.URL, "http://")
	return r
}

type stallingWriter struct {
	http.ResponseWriter
	r       *stallingRegistry
	ctx     context.Context
	written int
}

func (w *stallingWriter) Write(b []byte) (int, error) {
	if w.written+len(b) <= stallAfter {
		w.written += len(b)
		return w.ResponseWriter.Write(b)
	}
	n, err := w.ResponseWriter.Write(b[:stallAfter-w.written])
	w.written += n
	if err != nil {
		return n, err
	}
	w.ResponseWriter.(http.Flusher).Flush()
	w.r.once.Do(func() { close(w.r.stalled) })
	<-w.ctx.Done()
	return n, w.ctx.Err()
}

// A prepare is an operation like the others: a caller follows it in the
// events and cancels it mid-fetch (its registry stalled); it ends
// CANCELLED, its half-fetched file is gone from the cache, its journal
// entry too; while it runs it counts as one of the caller's operations.
func TestAgentPrepareCancelledMidFetch(t *testing.T) {
	reg := startStallingRegistry(t)
	store := []ociimage.Option{ociimage.WithInsecureRegistry(reg.host)}
	img, _, _ := memoryFileCheckpoint(t, reg.host+"/vm:snap", [3]int{}, 8<<20, store...)
	stateDir := t.TempDir()
	ta := startAgentConfig(t, Config{StateDir: stateDir, Resolver: newStaticResolver(), Store: store,
		AllowRepositories: []string{reg.host + "/vm"}, Limits: Limits{Operations: 1}})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute) // a guard against a hang only
	defer cancel()

	close(reg.armed)
	started, err := ta.client.Prepare(ctx, api.PrepareRequest{Image: img, Namespace: "tenant-a"})
	if err != nil {
		t.Fatal(err)
	}
	if started.Kind != api.KindPrepare || started.Namespace != "tenant-a" || started.Done() {
		t.Fatalf("the prepare's operation: %+v; want a prepare of tenant-a under way", started)
	}
	var states []string
	waited := make(chan api.Operation, 1)
	go func() {
		o, _ := ta.client.Wait(ctx, started.ID, func(o api.Operation) { states = append(states, o.State) })
		waited <- o
	}()
	select {
	case <-reg.stalled:
	case <-ctx.Done():
		t.Fatal("the prepare never fetched the RAM layer")
	}
	cache := RAMCacheDir(stateDir, "tenant-a")
	if partial := partialFiles(t, cache); len(partial) != 1 {
		t.Fatalf("mid-fetch, the cache holds partial files %v; want the one being filled", partial)
	}
	if _, err := os.Stat(filepath.Join(stateDir, "ops", started.ID+".json")); err != nil {
		t.Errorf("the running prepare is not in the journal: %v", err)
	}
	if _, err := ta.client.Prepare(ctx, api.PrepareRequest{Image: img, Namespace: "tenant-a"}); errcode.Of(err) != errcode.Busy {
		t.Errorf("a second prepare beyond the caller's one operation: %v, want BUSY", err)
	}

	if _, err := ta.client.Cancel(ctx, started.ID); err != nil {
		t.Fatal(err)
	}
	final := <-waited
	if final.State != api.StateCancelled || final.Error == nil || final.Prepare != nil {
		t.Fatalf("the cancelled prepare ended %s, error %+v, result %+v; want cancelled with an error", final.State, final.Error, final.Prepare)
	}
	if len(states) < 2 || states[0] != api.StatePending && states[0] != api.StateRunning || states[len(states)-1] != api.StateCancelled {
		t.Errorf("the events' states %v: want the prepare under way, then cancelled", states)
	}
	if partial := partialFiles(t, cache); len(partial) != 0 {
		t.Errorf("the cancelled prepare left %v in the cache", partial)
	}
	if files, _ := filepath.Glob(filepath.Join(cache, "*.ram")); len(files) != 0 {
		t.Errorf("the cancelled prepare left a RAM file: %v", files)
	}
	if _, err := os.Stat(filepath.Join(stateDir, "ops", started.ID+".json")); !os.IsNotExist(err) {
		t.Errorf("the ended prepare's journal entry: %v, want it removed", err)
	}
	if n := ta.srv.held.count(holderOf(Caller{Admin: true}), operations); n != 0 {
		t.Errorf("the caller still holds %d operations after its prepare ended", n)
	}
	if o, err := ta.client.Get(ctx, started.ID); err != nil || o.State != api.StateCancelled || o.Kind != api.KindPrepare {
		t.Errorf("the prepare as the agent lists it: %+v, %v; want it cancelled", o, err)
	}
}

// partialFiles are the files a fill is writing in a RAM cache (hidden,
// named for the file they become).
func partialFiles(t *testing.T, cache string) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(cache, ".sha256-*"))
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// A prepare the agent was running when it stopped is in its journal: the
// restarted agent reports it failed, to its namespace's callers only; an
// entry an older agent wrote (the namespace in its target only) is seen
// by the same callers.
func TestAgentRecoversAJournaledPrepare(t *testing.T) {
	stateDir := t.TempDir()
	j, err := openJournal(stateDir)
	if err != nil {
		t.Fatal(err)
	}
	prep := api.Operation{ID: "prep1", Kind: api.KindPrepare, State: api.StateRunning, Namespace: "tenant-a"}
	older := api.Operation{ID: "rest1", Kind: api.KindRestore, State: api.StateRunning, Target: &api.Target{PodUID: uid1, Container: "qemu", Namespace: "tenant-a"}}
	for _, o := range []api.Operation{prep, older} {
		if err := j.write(journalEntry{Op: o}); err != nil {
			t.Fatal(err)
		}
	}
	s := startAgentConfig(t, Config{StateDir: stateDir, Resolver: newStaticResolver()}).srv
	for _, id := range []string{"prep1", "rest1"} {
		o, err := s.visibleOp(withCaller(context.Background(), callerA), id)
		if err != nil {
			t.Fatalf("%s as tenant-a sees it: %v", id, err)
		}
		if d := o.snapshot(); d.State != api.StateFailed || d.Error == nil || !strings.Contains(d.Error.Message, "the agent stopped during this operation") {
			t.Errorf("%s recovered as %s %+v; want failed, saying the agent stopped", id, d.State, d.Error)
		}
		if _, err := s.visibleOp(withCaller(context.Background(), callerB), id); err == nil {
			t.Errorf("tenant-b sees tenant-a's %s", id)
		}
	}
	if entries, _ := s.journal.list(); len(entries) != 0 {
		t.Errorf("the journal still holds %d entries after recovery", len(entries))
	}
}
