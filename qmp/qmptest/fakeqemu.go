package qmptest

import (
	"bytes"
	"context"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"testing"

	goqmp "github.com/digitalocean/go-qemu/qmp"

	"github.com/vmsnap/vmsnap/qmp"
)

// FakeQEMU is a simulated QEMU 7.2 behind a Server: it answers the QMP
// commands vmsnap's capture and restore use (status, the compatibility
// record's queries, migration settings, stop/cont, getfd) and migrates a
// byte slice through the descriptors it is given, emitting MIGRATION events
// as QEMU does. Its fields may be set before the first command; read them
// with Lock held, or after WaitMigrations.
type FakeQEMU struct {
	Srv *Server

	mu            sync.Mutex
	status        string // running, paused, postmigrate, inmigrate
	Memory        int64  // bytes of guest memory the record reports
	State         []byte // what an outgoing migration writes; what an incoming one must read to succeed
	Received      []byte // what the last incoming migration read
	fds           map[string]*os.File
	Caps          map[string]bool
	Bandwidth     int64
	DowntimeLimit int64  // ms
	migration     string // what query-migrate reports

	// FailMigrate, if set, makes an outgoing migration write this many
	// bytes and then fail.
	FailMigrate int
	// LieStream makes an outgoing migration into a descriptor write State
	// and then zeros without end, until a write fails.
	LieStream bool
	// MidStream, if set, is called by an outgoing migration into a
	// descriptor once half of the state is written, and the rest is
	// written when it returns: a test holds a checkpoint in the middle of
	// its stream with it, for as long as it needs, instead of racing it.
	MidStream func()
	// RefuseMigrate makes the migrate command itself fail.
	RefuseMigrate bool
	// FailFirstMigrations makes the next outgoing migrations into a
	// descriptor, this many, write a few bytes and fail, the VM left in
	// the state it was in (a running one runs on, as with QEMU).
	FailFirstMigrations int
	// BadRAMStream makes a VM with a RAMBackend migrate State as it is,
	// not framed as QEMU frames a migration (RAMStream): a stream the
	// pre-copy cannot read.
	BadRAMStream bool
	// SharedMemdevs are more shared memory backends query-memdev lists
	// (ivshmem's, say), of 1 MiB each.
	SharedMemdevs []string
	done          sync.WaitGroup
	srv           atomic.Pointer[Server] // Srv, for the handlers
	fileMigration                        // add-fd and file: URIs, QEMU 9's mapped-ram (fakefile.go)
	fakeVMGenID                          // the vmgenid device, if VMGenID is set (fakevmgenid.go)

	// FeatureWords and FilteredFeatures are what the vCPU's x86 QOM
	// properties of those names report (QEMU 7.2's qemu64 model by
	// default, nothing filtered). Nil makes QEMU refuse the property, as
	// QEMU for another architecture does.
	FeatureWords     []FeatureWord
	FilteredFeatures []FeatureWord

	// Version is the QEMU version query-version reports (7.2.22 by
	// default); KVM whether query-kvm reports KVM enabled (TCG by
	// default, as the tests' guests run).
	Version [3]int
	KVM     bool

	// RAMBackend, if set, is the machine's memory backend (-machine
	// memory-backend=ID): its QOM type, mem-path and share, and size
	// Memory. Nil: a plain -m, no backend named.
	RAMBackend *FakeBackend
}

// FakeBackend is a memory backend of a FakeQEMU.
type FakeBackend struct {
	ID, Type, MemPath string
	Share             bool
	Size              int64 // 0: the guest's Memory
	// HostPath, if set, is the file the fake's RAM is (what its
	// migrations read) where MemPath names it in another mount namespace:
	// a QEMU in a container.
	HostPath string
}

// NewFakeQEMU starts a fake QEMU in the given run state ("running",
// "paused" or "inmigrate" for a restore target) whose migrations carry state.
func NewFakeQEMU(t testing.TB, status string, state []byte) *FakeQEMU {
	f := &FakeQEMU{status: status, migration: "none", Memory: 256 << 20, State: state, fds: map[string]*os.File{},
		Caps: map[string]bool{"events": false, "background-snapshot": false, "x-ignore-shared": false}, Bandwidth: 128 << 20, DowntimeLimit: 300,
		FeatureWords: Qemu64FeatureWords(), FilteredFeatures: []FeatureWord{}, Version: [3]int{7, 2, 22}}
	f.Srv = NewServer(t, f.handle)
	// Handlers emit events through srv: the server runs before the
	// assignment above, and its clients may be other processes, which the
	// race detector cannot see order anything.
	f.srv.Store(f.Srv)
	t.Cleanup(f.done.Wait)
	return f
}

// Dial connects a client, closed at the end of the test.
func (f *FakeQEMU) Dial(t testing.TB) *qmp.Client {
	c, err := qmp.Dial(context.Background(), f.Srv.Path())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// Path is the fake's QMP socket.
func (f *FakeQEMU) Path() string { return f.Srv.Path() }

// Status is the fake VM's run state.
func (f *FakeQEMU) Status() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.status
}

// Lock and Unlock guard the exported fields while migrations run.
func (f *FakeQEMU) Lock()   { f.mu.Lock() }
func (f *FakeQEMU) Unlock() { f.mu.Unlock() }

// WaitMigrations waits until no migration goroutine runs.
func (f *FakeQEMU) WaitMigrations() { f.done.Wait() }

// Commands lists the commands received, in order.
func (f *FakeQEMU) Commands() []string {
	var out []string
	for _, c := range f.Srv.Received() {
		out = append(out, c.Execute)
	}
	return out
}

// FeatureWord is one CPUID feature word as QEMU's x86 CPU reports it in
// its feature-words and filtered-features properties.
type FeatureWord struct {
	Register string  `json:"cpuid-register"`
	InputEAX uint32  `json:"cpuid-input-eax"`
	InputECX *uint32 `json:"cpuid-input-ecx,omitempty"`
	Features uint32  `json:"features"`
}

// Qemu64FeatureWords are the feature words QEMU 7.2's qemu64 CPU model sets
// under TCG, and one of the words it leaves zero (QEMU reports 24 words).
func Qemu64FeatureWords() []FeatureWord {
	zero := uint32(0)
	return []FeatureWord{
		{Register: "EDX", InputEAX: 0x1, Features: 0x078bfbfd},
		{Register: "ECX", InputEAX: 0x1, Features: 0x80002001},
		{Register: "EBX", InputEAX: 0x7, InputECX: &zero, Features: 0},
		{Register: "EDX", InputEAX: 0x80000001, Features: 0x2193fbfd},
		{Register: "ECX", InputEAX: 0x80000001, Features: 0x5},
	}
}

func (f *FakeQEMU) event(status string) {
	f.srv.Load().Emit(goqmp.Event{Event: "MIGRATION", Data: map[string]any{"status": status}})
}

// handle answers one command with f.mu held throughout: the commands of
// fileMigration first (they take over some of QEMU 7.2's), then the rest.
func (f *FakeQEMU) handle(_ *Server, cmd Command, files []*os.File) (any, *qmp.Error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if res, qerr, handled := f.handleFile(cmd, files); handled {
		return res, qerr
	}
	if res, ok := f.query(cmd.Execute); ok {
		return res, nil
	}
	if res, qerr, handled := f.handleVMGenID(cmd); handled {
		return res, qerr
	}
	switch cmd.Execute {
	case "qom-get":
		return f.qomGet(cmd)
	case "migrate-set-parameters":
		return nil, f.setMigrateParameters(cmd)
	case "migrate-set-capabilities":
		f.setMigrateCapabilities(cmd)
		return nil, nil
	case "getfd":
		return nil, f.getFD(cmd, files)
	case "closefd":
		return nil, f.closeFD(cmd)
	case "stop":
		f.status = "paused"
		return nil, nil
	case "cont":
		if f.status == "inmigrate" {
			return nil, genericError("migration is not done")
		}
		f.status = "running"
		return nil, nil
	case "quit":
		f.status = "shutdown"
		return nil, nil
	case "migrate":
		return nil, f.migrate(cmd)
	case "migrate-incoming":
		return nil, f.migrateIncoming(cmd)
	case "migrate_cancel":
		return nil, nil
	}
	return nil, &qmp.Error{Class: "CommandNotFound", Desc: "The command " + cmd.Execute + " has not been found"}
}

// outgoing is what a migration writes: State, framed as QEMU frames a
// migration if the VM's RAM is a memory backend.
func (f *FakeQEMU) outgoing() []byte {
	b := f.RAMBackend
	if b == nil || f.BadRAMStream {
		return f.State
	}
	size := b.Size
	if size == 0 {
		size = f.Memory
	}
	return RAMStream(b, size, f.Caps["x-ignore-shared"], f.State)
}

func (f *FakeQEMU) migrateOut(fd *os.File, state []byte, was string, fail bool) {
	defer f.done.Done()
	defer fd.Close()
	if fail {
		_, _ = fd.Write(state[:min(16, len(state))])
		fd.Close()
		f.mu.Lock()
		f.status, f.migration = was, "failed"
		f.mu.Unlock()
		f.event("failed")
		return
	}
	n := len(state)
	if f.FailMigrate > 0 {
		n = f.FailMigrate
	}
	half := n
	if f.MidStream != nil {
		half = n / 2
	}
	_, err := fd.Write(state[:half])
	if err == nil && half < n {
		f.MidStream()
		_, err = fd.Write(state[half:n])
	}
	if err == nil && f.LieStream {
		zeros := make([]byte, 1<<20)
		for err == nil {
			_, err = fd.Write(zeros)
		}
	}
	fd.Close()
	f.mu.Lock()
	if err != nil || f.FailMigrate > 0 {
		f.status = was // a failed migration leaves the VM as it was, as QEMU's does
		f.migration = "failed"
		f.mu.Unlock()
		f.event("failed")
		return
	}
	f.status = "postmigrate"
	f.migration = "completed"
	f.mu.Unlock()
	if was == "running" { // QEMU stops the VM for the final pass
		f.srv.Load().Emit(goqmp.Event{Event: "STOP"})
	}
	f.event("completed")
}

func (f *FakeQEMU) migrateIn(fd *os.File) {
	defer f.done.Done()
	defer fd.Close()
	got, _ := io.ReadAll(fd)
	f.load(got)
}

// load ends an incoming migration that read got: it completes (the VM
// paused, as QEMU leaves it) if got is State, and fails otherwise.
func (f *FakeQEMU) load(got []byte) {
	f.mu.Lock()
	f.Received = got
	ok := bytes.Equal(got, f.outgoing())
	f.migration = "failed"
	if ok {
		f.status = "paused"
		f.migration = "completed"
	}
	f.mu.Unlock()
	if ok {
		f.event("completed")
	} else {
		f.event("failed")
	}
}
