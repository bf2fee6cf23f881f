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

func (f *FakeQEMU) handle(_ *Server, cmd Command, files []*os.File) (any, *qmp.Error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	gerr := func(desc string) *qmp.Error { return &qmp.Error{Class: "GenericError", Desc: desc} }
	if res, qerr, handled := f.handleFile(cmd, files); handled {
		return res, qerr
	}
	switch cmd.Execute {
	case "query-status":
		return map[string]any{"status": f.status, "running": f.status == "running"}, nil
	case "query-version":
		return map[string]any{"qemu": map[string]int{"major": f.Version[0], "minor": f.Version[1], "micro": f.Version[2]}, "package": "fake"}, nil
	case "query-kvm":
		return map[string]bool{"enabled": f.KVM, "present": f.KVM}, nil
	case "query-target":
		return map[string]string{"arch": "x86_64"}, nil
	case "qom-get":
		var a struct{ Path, Property string }
		_ = cmd.Args(&a)
		if b := f.RAMBackend; b != nil && a.Path == "/objects/"+b.ID {
			switch a.Property {
			case "type":
				return b.Type, nil
			case "mem-path":
				return b.MemPath, nil
			case "readonly":
				return false, nil
			}
			return nil, gerr("Property '" + a.Property + "' not found")
		}
		if b := f.RAMBackend; b != nil && a.Path == "/objects/"+b.ID+"/"+b.ID+"[0]" && a.Property == "addr" {
			return 0, nil // the backend's memory region, mapped through aliases on a pc
		}
		if a.Path == "/machine" && a.Property == "memory-backend" {
			if f.RAMBackend == nil {
				return "", nil
			}
			return "/objects/" + f.RAMBackend.ID, nil
		}
		if a.Path == "/machine" {
			return "pc-i440fx-7.2-machine", nil
		}
		switch a.Property {
		case "feature-words", "filtered-features":
			words := f.FeatureWords
			if a.Property == "filtered-features" {
				words = f.FilteredFeatures
			}
			if words == nil {
				return nil, gerr("Property 'qemu64-x86_64-cpu." + a.Property + "' not found")
			}
			return words, nil
		}
		return "qemu64-x86_64-cpu", nil
	case "query-cpus-fast":
		return []map[string]any{{"cpu-index": 0, "qom-path": "/machine/unattached/device[0]"}}, nil
	case "query-memdev":
		out := []map[string]any{}
		if b := f.RAMBackend; b != nil {
			size := b.Size
			if size == 0 {
				size = f.Memory
			}
			out = append(out, map[string]any{"id": b.ID, "size": size, "share": b.Share, "merge": true, "dump": true, "prealloc": false, "policy": "default", "host-nodes": []int{}})
		}
		for _, id := range f.SharedMemdevs {
			out = append(out, map[string]any{"id": id, "size": 1 << 20, "share": true, "merge": true, "dump": true, "prealloc": false, "policy": "default", "host-nodes": []int{}})
		}
		return out, nil
	case "query-memory-size-summary":
		return map[string]int64{"base-memory": f.Memory, "plugged-memory": 0}, nil
	case "query-pci":
		return []map[string]any{{"bus": 0, "devices": []map[string]any{
			{"bus": 0, "slot": 0, "function": 0, "qdev_id": "", "class_info": map[string]any{"class": 1536}, "id": map[string]any{"vendor": 32902, "device": 4663}},
		}}}, nil
	case "query-block":
		return []map[string]any{}, nil
	case "query-migrate-parameters":
		return map[string]any{"max-bandwidth": f.Bandwidth, "downtime-limit": f.DowntimeLimit}, nil
	case "migrate-set-parameters":
		var a struct {
			MaxBandwidth  *int64 `json:"max-bandwidth"`
			DowntimeLimit *int64 `json:"downtime-limit"`
		}
		_ = cmd.Args(&a)
		if a.MaxBandwidth != nil {
			f.Bandwidth = *a.MaxBandwidth
		}
		if a.DowntimeLimit != nil {
			if *a.DowntimeLimit > 2000000 {
				return nil, gerr("Parameter 'downtime_limit' expects an integer in the range of 0 to 2000000 milliseconds")
			}
			f.DowntimeLimit = *a.DowntimeLimit
		}
		return nil, nil
	case "query-migrate-capabilities":
		var out []map[string]any
		for c, s := range f.Caps {
			out = append(out, map[string]any{"capability": c, "state": s})
		}
		return out, nil
	case "migrate-set-capabilities":
		var a struct {
			Capabilities []struct {
				Capability string
				State      bool
			}
		}
		_ = cmd.Args(&a)
		for _, c := range a.Capabilities {
			f.Caps[c.Capability] = c.State
		}
		return nil, nil
	case "getfd":
		var a struct{ Fdname string }
		_ = cmd.Args(&a)
		if len(files) != 1 {
			return nil, gerr("No file descriptor supplied via SCM_RIGHTS")
		}
		f.fds[a.Fdname] = files[0]
		return nil, nil
	case "stop":
		f.status = "paused"
		return nil, nil
	case "cont":
		if f.status == "inmigrate" {
			return nil, gerr("migration is not done")
		}
		f.status = "running"
		return nil, nil
	case "closefd":
		var a struct{ Fdname string }
		_ = cmd.Args(&a)
		fd, ok := f.fds[a.Fdname]
		if !ok {
			return nil, gerr("File descriptor named '" + a.Fdname + "' not found")
		}
		fd.Close()
		delete(f.fds, a.Fdname)
		return nil, nil
	case "quit":
		f.status = "shutdown"
		return nil, nil
	case "migrate":
		if f.RefuseMigrate {
			return nil, gerr("There's a migration process in progress")
		}
		var a struct{ URI string }
		_ = cmd.Args(&a)
		fd := f.fds[a.URI[len("fd:"):]]
		if fd == nil {
			return nil, gerr("unknown fd")
		}
		if f.status == "postmigrate" {
			return nil, gerr("Can't migrate the vm that was paused due to previous migration")
		}
		delete(f.fds, a.URI[len("fd:"):])
		f.migration = "active"
		f.done.Add(1)
		fail := f.FailFirstMigrations > 0
		if fail {
			f.FailFirstMigrations--
		}
		go f.migrateOut(fd, f.outgoing(), f.status, fail)
		return nil, nil
	case "migrate-incoming":
		var a struct{ URI string }
		_ = cmd.Args(&a)
		fd := f.fds[a.URI[len("fd:"):]]
		if fd == nil {
			return nil, gerr("unknown fd")
		}
		f.migration = "active"
		f.done.Add(1)
		go f.migrateIn(fd)
		return nil, nil
	case "query-migrate":
		return map[string]any{"status": f.migration}, nil
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
