package vmstate

import (
	"bytes"
	"context"
	"io"
	"os"
	"sync"
	"testing"

	goqmp "github.com/digitalocean/go-qemu/qmp"

	"github.com/vmsnap/vmsnap/qmp"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// fakeQEMU answers the QMP commands capture and restore use, and migrates
// a byte slice through the descriptors it is given, like QEMU 7.2 does.
type fakeQEMU struct {
	t   testing.TB
	srv *qmptest.Server

	mu       sync.Mutex
	status   string // running, paused, postmigrate, inmigrate
	memory   int64
	state    []byte // what migrate writes
	received []byte // what migrate-incoming read
	fds      map[string]*os.File
	caps     map[string]bool
	bw       int64
	// migration is what query-migrate reports
	migration string

	// failMigrate, if set, makes migrate write this many bytes and fail.
	failMigrate int
	// loadErr, if set, is the error-desc of a failed incoming migration.
	incomingFails bool
	done          sync.WaitGroup
}

func newFakeQEMU(t testing.TB, status string, state []byte) *fakeQEMU {
	f := &fakeQEMU{t: t, status: status, migration: "none", memory: 256 << 20, state: state, fds: map[string]*os.File{},
		caps: map[string]bool{"events": false, "background-snapshot": false}, bw: 128 << 20}
	f.srv = qmptest.NewServer(t, f.handle)
	t.Cleanup(f.done.Wait)
	return f
}

func (f *fakeQEMU) dial(t testing.TB) *qmp.Client {
	c, err := qmp.Dial(context.Background(), f.srv.Path())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func (f *fakeQEMU) Status() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.status
}

// commands lists the commands received, in order.
func (f *fakeQEMU) commands() []string {
	var out []string
	for _, c := range f.srv.Received() {
		out = append(out, c.Execute)
	}
	return out
}

func (f *fakeQEMU) event(status string) {
	f.srv.Emit(goqmp.Event{Event: "MIGRATION", Data: map[string]any{"status": status}})
}

func (f *fakeQEMU) handle(_ *qmptest.Server, cmd qmptest.Command, files []*os.File) (any, *qmp.Error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	gerr := func(desc string) *qmp.Error { return &qmp.Error{Class: "GenericError", Desc: desc} }
	switch cmd.Execute {
	case "query-status":
		return map[string]any{"status": f.status, "running": f.status == "running"}, nil
	case "query-version":
		return map[string]any{"qemu": map[string]int{"major": 7, "minor": 2, "micro": 22}, "package": "fake"}, nil
	case "query-target":
		return map[string]string{"arch": "x86_64"}, nil
	case "qom-get":
		var a struct{ Path string }
		_ = cmd.Args(&a)
		if a.Path == "/machine" {
			return "pc-i440fx-7.2-machine", nil
		}
		return "qemu64-x86_64-cpu", nil
	case "query-cpus-fast":
		return []map[string]any{{"cpu-index": 0, "qom-path": "/machine/unattached/device[0]"}}, nil
	case "query-memory-size-summary":
		return map[string]int64{"base-memory": f.memory, "plugged-memory": 0}, nil
	case "query-pci":
		return []map[string]any{{"bus": 0, "devices": []map[string]any{
			{"bus": 0, "slot": 0, "function": 0, "qdev_id": "", "class_info": map[string]any{"class": 1536}, "id": map[string]any{"vendor": 32902, "device": 4663}},
		}}}, nil
	case "query-block":
		return []map[string]any{}, nil
	case "query-migrate-parameters":
		return map[string]any{"max-bandwidth": f.bw}, nil
	case "migrate-set-parameters":
		var a struct {
			MaxBandwidth int64 `json:"max-bandwidth"`
		}
		_ = cmd.Args(&a)
		f.bw = a.MaxBandwidth
		return nil, nil
	case "query-migrate-capabilities":
		var out []map[string]any
		for c, s := range f.caps {
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
			f.caps[c.Capability] = c.State
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
	case "migrate":
		var a struct{ URI string }
		_ = cmd.Args(&a)
		fd := f.fds[a.URI[len("fd:"):]]
		if fd == nil {
			return nil, gerr("unknown fd")
		}
		delete(f.fds, a.URI[len("fd:"):])
		f.migration = "active"
		f.done.Add(1)
		go f.migrateOut(fd)
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

func (f *fakeQEMU) migrateOut(fd *os.File) {
	defer f.done.Done()
	defer fd.Close()
	n := len(f.state)
	if f.failMigrate > 0 {
		n = f.failMigrate
	}
	_, err := fd.Write(f.state[:n])
	fd.Close()
	f.mu.Lock()
	if err != nil || f.failMigrate > 0 {
		f.status = "paused"
		f.migration = "failed"
		f.mu.Unlock()
		f.event("failed")
		return
	}
	f.status = "postmigrate"
	f.migration = "completed"
	f.mu.Unlock()
	f.event("completed")
}

func (f *fakeQEMU) migrateIn(fd *os.File) {
	defer f.done.Done()
	defer fd.Close()
	var buf bytes.Buffer
	_, _ = io.Copy(&buf, fd)
	f.mu.Lock()
	f.received = buf.Bytes()
	ok := bytes.Equal(f.received, f.state) && !f.incomingFails
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
