package qmptest

import (
	"os"

	"github.com/vmsnap/vmsnap/qmp"
)

// genericError is the error QEMU answers most failed commands with.
func genericError(desc string) *qmp.Error {
	return &qmp.Error{Class: "GenericError", Desc: desc}
}

// query answers the query commands that only read f (with f.mu held);
// ok is false for any other command.
func (f *FakeQEMU) query(execute string) (res any, ok bool) {
	switch execute {
	case "query-status":
		return map[string]any{"status": f.status, "running": f.status == "running"}, true
	case "query-version":
		return map[string]any{"qemu": map[string]int{"major": f.Version[0], "minor": f.Version[1], "micro": f.Version[2]}, "package": "fake"}, true
	case "query-kvm":
		return map[string]bool{"enabled": f.KVM, "present": f.KVM}, true
	case "query-target":
		return map[string]string{"arch": "x86_64"}, true
	case "query-cpus-fast":
		return []map[string]any{{"cpu-index": 0, "qom-path": "/machine/unattached/device[0]"}}, true
	case "query-memdev":
		return f.queryMemdev(), true
	case "query-memory-size-summary":
		return map[string]int64{"base-memory": f.Memory, "plugged-memory": 0}, true
	case "query-pci":
		return []map[string]any{{"bus": 0, "devices": []map[string]any{
			{"bus": 0, "slot": 0, "function": 0, "qdev_id": "", "class_info": map[string]any{"class": 1536}, "id": map[string]any{"vendor": 32902, "device": 4663}},
		}}}, true
	case "query-block":
		return []map[string]any{}, true
	case "query-migrate-parameters":
		return map[string]any{"max-bandwidth": f.Bandwidth, "downtime-limit": f.DowntimeLimit}, true
	case "query-migrate-capabilities":
		var out []map[string]any
		for c, s := range f.Caps {
			out = append(out, map[string]any{"capability": c, "state": s})
		}
		return out, true
	case "query-migrate":
		return map[string]any{"status": f.migration}, true
	}
	return nil, false
}

// qomGet answers qom-get for the RAM backend, the machine and the CPU.
func (f *FakeQEMU) qomGet(cmd Command) (any, *qmp.Error) {
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
		return nil, genericError("Property '" + a.Property + "' not found")
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
			return nil, genericError("Property 'qemu64-x86_64-cpu." + a.Property + "' not found")
		}
		return words, nil
	}
	return "qemu64-x86_64-cpu", nil
}

// queryMemdev lists the RAM backend, if any, and the shared memdevs.
func (f *FakeQEMU) queryMemdev() []map[string]any {
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
	return out
}

// setMigrateParameters sets max-bandwidth and downtime-limit, refusing a
// downtime-limit QEMU refuses.
func (f *FakeQEMU) setMigrateParameters(cmd Command) *qmp.Error {
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
			return genericError("Parameter 'downtime_limit' expects an integer in the range of 0 to 2000000 milliseconds")
		}
		f.DowntimeLimit = *a.DowntimeLimit
	}
	return nil
}

func (f *FakeQEMU) setMigrateCapabilities(cmd Command) {
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
}

// getFD keeps the one descriptor passed with getfd under its name.
func (f *FakeQEMU) getFD(cmd Command, files []*os.File) *qmp.Error {
	var a struct{ Fdname string }
	_ = cmd.Args(&a)
	if len(files) != 1 {
		return genericError("No file descriptor supplied via SCM_RIGHTS")
	}
	f.fds[a.Fdname] = files[0]
	return nil
}

func (f *FakeQEMU) closeFD(cmd Command) *qmp.Error {
	var a struct{ Fdname string }
	_ = cmd.Args(&a)
	fd, ok := f.fds[a.Fdname]
	if !ok {
		return genericError("File descriptor named '" + a.Fdname + "' not found")
	}
	fd.Close()
	delete(f.fds, a.Fdname)
	return nil
}

// migrate starts an outgoing migration into a descriptor passed with
// getfd, failing it if FailFirstMigrations says so.
func (f *FakeQEMU) migrate(cmd Command) *qmp.Error {
	if f.RefuseMigrate {
		return genericError("There's a migration process in progress")
	}
	var a struct{ URI string }
	_ = cmd.Args(&a)
	fd := f.fds[a.URI[len("fd:"):]]
	if fd == nil {
		return genericError("unknown fd")
	}
	if f.status == "postmigrate" {
		return genericError("Can't migrate the vm that was paused due to previous migration")
	}
	delete(f.fds, a.URI[len("fd:"):])
	f.migration = "active"
	f.done.Add(1)
	fail := f.FailFirstMigrations > 0
	if fail {
		f.FailFirstMigrations--
	}
	go f.migrateOut(fd, f.outgoing(), f.status, fail)
	return nil
}

// migrateIncoming starts an incoming migration from a descriptor passed
// with getfd.
func (f *FakeQEMU) migrateIncoming(cmd Command) *qmp.Error {
	var a struct{ URI string }
	_ = cmd.Args(&a)
	fd := f.fds[a.URI[len("fd:"):]]
	if fd == nil {
		return genericError("unknown fd")
	}
	f.migration = "active"
	f.done.Add(1)
	go f.migrateIn(fd)
	return nil
}
