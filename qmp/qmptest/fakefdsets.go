package qmptest

import (
	"os"
	"strconv"
	"strings"

	"github.com/vmsnap/vmsnap/qmp"
)

// addFD puts the one descriptor passed with add-fd into a new fdset.
func (f *FakeQEMU) addFD(files []*os.File) (any, *qmp.Error, bool) {
	if len(files) != 1 {
		return nil, genericError("No file descriptor supplied via SCM_RIGHTS"), true
	}
	if f.fdsets == nil {
		f.fdsets = map[int64]*os.File{}
	}
	id := f.nextFDSet
	f.nextFDSet++
	f.fdsets[id] = files[0]
	return map[string]int64{"fdset-id": id, "fd": 100 + id}, nil, true
}

// removeFD removes an fdset and closes its descriptor, or keeps it open
// (reopened for writing with UpgradeHeld) under HoldRemovedFDs.
func (f *FakeQEMU) removeFD(cmd Command) *qmp.Error {
	var a struct {
		ID int64 `json:"fdset-id"`
	}
	_ = cmd.Args(&a)
	file, ok := f.fdsets[a.ID]
	if !ok {
		return genericError("File descriptor named 'fdset-id:" + strconv.FormatInt(a.ID, 10) + "' not found")
	}
	if f.holdFDs && f.UpgradeHeld {
		if w, err := os.OpenFile("/proc/self/fd/"+strconv.Itoa(int(file.Fd())), os.O_WRONLY, 0); err == nil {
			file.Close()
			file = w
		}
	}
	if f.holdFDs {
		f.held = append(f.held, file)
	} else {
		file.Close()
	}
	delete(f.fdsets, a.ID)
	return nil
}

func (f *FakeQEMU) queryFDSets() []map[string]any {
	out := []map[string]any{}
	for id := range f.fdsets {
		out = append(out, map[string]any{"fdset-id": id, "fds": []map[string]int64{{"fd": 100 + id}}})
	}
	return out
}

// setMultifdChannels takes the multifd-channels parameter; it returns
// handled false so that the main handler sets the other parameters.
func (f *FakeQEMU) setMultifdChannels(cmd Command) (any, *qmp.Error, bool) {
	var a struct {
		Channels *int64 `json:"multifd-channels"`
	}
	_ = cmd.Args(&a)
	if a.Channels != nil {
		if f.MultifdChannels == 0 {
			return nil, genericError("Parameter 'multifd-channels' is unexpected"), true
		}
		f.MultifdChannels = *a.Channels
	}
	return nil, nil, false
}

// fileMigrate records a migrate or migrate-incoming URI and starts the
// migration if it is into or from an fdset; other URIs are left to the
// main handler, except "fd:" with mapped-ram, which QEMU refuses.
func (f *FakeQEMU) fileMigrate(cmd Command) (any, *qmp.Error, bool) {
	var a struct{ URI string }
	_ = cmd.Args(&a)
	f.MigrateURIs = append(f.MigrateURIs, a.URI)
	mapped := f.Caps["mapped-ram"]
	if !strings.HasPrefix(a.URI, fdsetPrefix) {
		if mapped && strings.HasPrefix(a.URI, "fd:") {
			return nil, genericError("Migration requires seekable transport (e.g. file)"), true
		}
		return nil, nil, false
	}
	id, err := strconv.ParseInt(strings.TrimPrefix(a.URI, fdsetPrefix), 10, 64)
	file := f.fdsets[id]
	if err != nil || file == nil {
		return nil, genericError("Outgoing migration needs an fdset: " + a.URI + " not found"), true
	}
	f.migration = "active"
	f.errorDesc = ""
	f.done.Add(1)
	if cmd.Execute == "migrate" {
		go f.migrateFileOut(file, mapped)
	} else {
		go f.migrateFileIn(file)
	}
	return nil, nil, true
}
