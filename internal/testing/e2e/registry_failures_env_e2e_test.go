//go:build linux

package e2e

// What the failure table (registry_failures_e2e_test.go) runs against: the
// real registry with the images every command reads, a misbehaving server
// per fault in front of it, and a node agent in this process whose
// resolver knows the table's fake QEMUs.

import (
	"context"
	"crypto/rand"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// registryFaults is every fault of the table. The hosts of the first four
// are set by newFailureEnv; the others are servers of the test's own.
func registryFaults() []registryFault {
	return []registryFault{
		{name: "connection refused"},
		{name: "DNS failure"},
		{name: "not HTTP"},
		{name: "TLS unknown CA"},
		{name: "401", status: http.StatusUnauthorized, everywhere: true, body: registryError("UNAUTHORIZED", "authentication required")},
		{name: "403", status: http.StatusForbidden, body: registryError("DENIED", "requested access to the resource is denied")},
		{name: "404", status: http.StatusNotFound, body: registryError("NAME_UNKNOWN", "repository name not known to registry")},
		{name: "429", status: http.StatusTooManyRequests, body: registryError("TOOMANYREQUESTS", "rate limit exceeded")},
		{name: "429 Retry-After 3600", status: http.StatusTooManyRequests, retryAfter: "3600", body: registryError("TOOMANYREQUESTS", "rate limit exceeded")},
		{name: "500", status: http.StatusInternalServerError, body: registryError("UNKNOWN", "unknown error")},
		{name: "503 Retry-After 1", status: http.StatusServiceUnavailable, retryAfter: "1", body: "<html>down for maintenance</html>"},
		{name: "stall mid-blob", blob: stallBlob},
		{name: "truncated blob", blob: truncateBlob},
		{name: "cut mid-blob", blob: cutBlob},
	}
}

// failureEnv is what every run of the table shares.
type failureEnv struct {
	reg       *registry.Registry
	hosts     map[string]string // fault name -> HOST[:PORT]
	caFile    string            // the faulty servers' certificate (not the registry's CA)
	configDir string            // credentials for every faulty server
	overlay   string            // the source VM's disk overlay

	state, disk, memoryFile string // digests of the images the commands read

	agentSocket, agentState string
	agentLog                *os.File
	pods                    *fakePods
}

func newFailureEnv(t *testing.T) *failureEnv {
	t.Helper()
	e := &failureEnv{reg: registry.Start(t), hosts: map[string]string{}, overlay: guest.NewDisk(t, t.TempDir())}
	e.pushImages(t)
	quit := make(chan struct{})
	var faulty []string
	for _, f := range registryFaults() {
		switch f.name {
		case "connection refused":
			e.hosts[f.name] = closedPort(t)
		case "DNS failure":
			e.hosts[f.name] = "registry.invalid:5000"
		case "not HTTP":
			e.hosts[f.name] = startNotHTTP(t)
		case "TLS unknown CA":
			e.hosts[f.name] = e.reg.Host // its CA is not among those given
		default:
			srv := startFaultyRegistry(t, e.reg, f, quit)
			e.hosts[f.name] = srv.Listener.Addr().String()
			faulty = append(faulty, e.hosts[f.name])
			if e.caFile == "" {
				// httptest's servers share one certificate.
				e.caFile = certificateFile(t, srv)
			}
		}
	}
	// Before the servers close (cleanups run last first): a handler that
	// stalls mid-body waits for quit, as a half-read request's context
	// does not end when its connection closes.
	t.Cleanup(func() { close(quit) })
	e.configDir = dockerConfig(t, e.reg, faulty...)
	e.startAgent(t)
	return e
}

// pushImages checkpoints a fake QEMU with a disk overlay, and one whose
// RAM is a shared file (memory-file), into the real registry.
func (e *failureEnv) pushImages(t *testing.T) {
	t.Helper()
	vm := qmptest.NewFakeQEMU(t, "running", randomBytes(t, 1<<20))
	cp := cliJSON[api.CheckpointResult](t, with([]string{"checkpoint", "--qmp", vm.Path(), "--image", e.reg.Host + "/vms/fail:t",
		"--disk", e.overlay, "--disk-image", e.reg.Host + "/vms/fail-disk:t", "--chunk-size", "262144"}, regArgs(e.reg)...)...)
	e.state, e.disk = cp.VMState.Digest, cp.Disk.Digest

	ram := randomBytes(t, 4<<20)
	ramPath := filepath.Join(t.TempDir(), "guest.ram")
	if err := os.WriteFile(ramPath, ram, 0o600); err != nil {
		t.Fatal(err)
	}
	qmptest.MapFile(t, ramPath) // as QEMU does: vmsnap reads only a file its QEMU maps
	mf := qmptest.NewFakeQEMU(t, "running", randomBytes(t, 32<<10))
	mf.Memory = int64(len(ram))
	mf.RAMBackend = &qmptest.FakeBackend{ID: "ram0", Type: "memory-backend-file", MemPath: ramPath, Share: true}
	mf.Caps["x-ignore-shared"] = false
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := snapshot.Checkpoint(ctx, snapshot.CheckpointSpec{QMPPath: mf.Path(), Image: e.reg.Host + "/vms/fail-mf:t", Mode: "snapshot",
		Store: []ociimage.Option{ociimage.WithRegistryConfig(e.reg.ConfigDir), ociimage.WithCAFile(e.reg.CAFile)}})
	if err != nil || res.VMState.Format != "memory-file" {
		t.Fatalf("checkpointing a memory-file VM: %v (%+v)", err, res)
	}
	e.memoryFile = res.VMState.Digest
}

// startAgent runs a node agent in this process, allowed every host of the
// table, with the faulty servers' credentials and certificate.
func (e *failureEnv) startAgent(t *testing.T) {
	t.Helper()
	dir, err := os.MkdirTemp("", "vmsnap-fail-") // short: a unix socket path
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	e.agentSocket, e.agentState = filepath.Join(dir, "agent.sock"), filepath.Join(dir, "state")
	if e.agentLog, err = os.Create(filepath.Join(t.TempDir(), "agent.log")); err != nil {
		t.Fatal(err)
	}
	e.pods = &fakePods{qmp: map[string]string{}}
	var allow []string
	for _, h := range e.hosts {
		allow = append(allow, h+"/vms")
	}
	srv, err := agent.New(context.Background(), agent.Config{Socket: e.agentSocket, StateDir: e.agentState, Resolver: e.pods,
		Store:             []ociimage.Option{ociimage.WithRegistryConfig(e.configDir), ociimage.WithCAFile(e.caFile)},
		AllowRepositories: allow, OperationTimeout: agentOperationTimeout, MaxConcurrent: 16,
		Logger: slog.New(slog.NewJSONHandler(e.agentLog, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	c, err := agent.NewClient("unix://" + e.agentSocket)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(15 * time.Second); c.Health(context.Background()) != nil; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the agent did not come up")
		}
	}
}

// agentOperationTimeout bounds the agent's operations in the table: a
// stalled registry ends there.
const agentOperationTimeout = 30 * time.Second

// regArgs are a CLI run's registry flags.
func (e *failureEnv) regArgs() []string {
	return []string{"--registry-config", e.configDir, "--ca-file", e.caFile}
}

// fakePods is the agent's resolver: pod UIDs of the table's fake QEMUs.
type fakePods struct {
	mu  sync.Mutex
	qmp map[string]string // pod UID -> the fake's socket
}

func (p *fakePods) add(vm *qmptest.FakeQEMU) string {
	b := make([]byte, 8)
	rand.Read(b)
	uid := fmt.Sprintf("6f1c2a4e-%x-4c0e-9a51-0123456789ab", b)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.qmp[uid] = vm.Path()
	return uid
}

func (p *fakePods) Resolve(_ context.Context, ref agent.VMRef) (*agent.Resolved, error) {
	p.mu.Lock()
	path, ok := p.qmp[ref.PodUID]
	p.mu.Unlock()
	if !ok {
		return nil, errcode.New(errcode.VMNotFound, "no pod %s", ref.PodUID)
	}
	h, err := snapshot.OpenLocal(path, "")
	if err != nil {
		return nil, err
	}
	return &agent.Resolved{Target: agent.Target{PodUID: ref.PodUID, Container: ref.Container, ContainerID: "c-" + ref.PodUID, QMPPath: path}, Handles: *h}, nil
}

func (p *fakePods) Watch(ctx context.Context) (<-chan agent.Gone, error) {
	c := make(chan agent.Gone)
	go func() { <-ctx.Done(); close(c) }()
	return c, nil
}
