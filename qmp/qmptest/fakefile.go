package qmptest

import (
	"bytes"
	"io"
	"maps"
	"os"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/qmp"
)

// fileMigration is the part of FakeQEMU that plays a QEMU 9.0 or later:
// fdsets (add-fd, remove-fd, query-fdsets) and migrations into and from
// "file:/dev/fdset/N", laid out as mapped-ram does (zero pages left as
// holes) when that capability is on. Call EnableMappedRAM to offer the
// capabilities; without it the fake is QEMU 7.2 as before.
type fileMigration struct {
	fdsets    map[int64]*os.File
	nextFDSet int64
	// MultifdChannels, if not 0, is the multifd-channels parameter, which
	// query-migrate-parameters then reports and migrate-set-parameters sets.
	MultifdChannels int64
	// MigrateURIs are the URIs of every migrate and migrate-incoming, in order.
	MigrateURIs []string
	// FileErrorDesc, if set, makes a migration into a file fail with this
	// error-desc in query-migrate (as "No space left on device").
	FileErrorDesc string
	// FileSize and FileAllocated are the size and allocated bytes of the
	// file of the last outgoing file migration, once it completed.
	FileSize, FileAllocated int64
	// LieGrow makes a migration into a file write without end (1 MiB
	// blocks of data, one after another) until it is cancelled, a write
	// fails or lieGrowLimit is reached, as a QEMU under someone else's
	// control could. FileMaxSize and FileMaxAllocated are the most the
	// file held meanwhile.
	LieGrow                       bool
	FileMaxSize, FileMaxAllocated int64
	// LieSparseSize, if not 0, makes a migration into a file write the
	// state and then extend the file to this size (a hole) before it
	// reports completion.
	LieSparseSize int64
	// UpgradeHeld makes HoldRemovedFDs keep, instead of a removed
	// descriptor, one reopened for writing (through /proc/self/fd), as a
	// QEMU under someone else's control and allowed to could.
	UpgradeHeld bool
	errorDesc   string     // of the last failed file migration
	holdFDs     bool       // HoldRemovedFDs
	held        []*os.File // removed from their fdsets, still open
}

// EnableMappedRAM makes the fake offer the mapped-ram and multifd
// migration capabilities (off) and the multifd-channels parameter (2), as
// QEMU 9.0 and later do, and be QEMU 9.0 if it was older.
func (f *FakeQEMU) EnableMappedRAM() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.Version[0] < 9 {
		f.Version = [3]int{9, 0, 0}
	}
	f.Caps["mapped-ram"] = false
	f.Caps["multifd"] = false
	f.MultifdChannels = 2
}

// FDSets is how many fdsets QEMU holds.
func (f *FakeQEMU) FDSets() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.fdsets)
}

// HoldRemovedFDs makes remove-fd keep the fdset's descriptor open until the
// end of the test, as QEMU 9.0 does while the VM is not running (it closes
// a removed fdset's descriptors only while the VM runs), and as any QEMU
// does when a remove-fd is lost. HeldFiles reports on those files.
func (f *FakeQEMU) HoldRemovedFDs(t testing.TB) {
	f.mu.Lock()
	f.holdFDs = true
	f.mu.Unlock()
	t.Cleanup(func() {
		f.done.Wait()
		f.mu.Lock()
		defer f.mu.Unlock()
		for _, h := range f.held {
			h.Close()
		}
		f.held = nil
	})
}

// WriteHeld writes n bytes of data at the end of each file removed from
// its fdset that HoldRemovedFDs kept open, as a QEMU that keeps writing
// after its operation ended.
func (f *FakeQEMU) WriteHeld(n int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	block := bytes.Repeat([]byte{0x5a}, 1<<20)
	for _, h := range f.held {
		fi, err := h.Stat()
		if err != nil {
			return err
		}
		for off := int64(0); off < n; off += int64(len(block)) {
			if _, err := h.WriteAt(block[:min(int64(len(block)), n-off)], fi.Size()+off); err != nil {
				return err
			}
		}
	}
	return nil
}

// CloseHeld closes the files HoldRemovedFDs kept open: QEMU lets go.
func (f *FakeQEMU) CloseHeld() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, h := range f.held {
		h.Close()
	}
	f.held = nil
}

// HeldFile is a file QEMU still holds open.
type HeldFile struct {
	Size, Allocated int64
}

// HeldFiles reports on every file QEMU holds: those of the fdsets it has,
// then those removed from theirs that HoldRemovedFDs kept open.
func (f *FakeQEMU) HeldFiles() ([]HeldFile, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	files := slices.Clone(f.held)
	for _, id := range slices.Sorted(maps.Keys(f.fdsets)) {
		files = append(files, f.fdsets[id])
	}
	var out []HeldFile
	for _, h := range files {
		fi, err := h.Stat()
		if err != nil {
			return nil, err
		}
		out = append(out, HeldFile{Size: fi.Size(), Allocated: allocated(fi)})
	}
	return out, nil
}

const fdsetPrefix = "file:/dev/fdset/"

// handleFile answers the commands of fileMigration, with f.mu held; it
// returns handled false for the others (and for migrate-set-parameters,
// which the main handler finishes).
func (f *FakeQEMU) handleFile(cmd Command, files []*os.File) (any, *qmp.Error, bool) {
	switch cmd.Execute {
	case "add-fd":
		return f.addFD(files)
	case "remove-fd":
		return nil, f.removeFD(cmd), true
	case "query-fdsets":
		return f.queryFDSets(), nil, true
	case "query-migrate-parameters":
		if f.MultifdChannels == 0 {
			return nil, nil, false
		}
		return map[string]any{"max-bandwidth": f.Bandwidth, "downtime-limit": f.DowntimeLimit, "multifd-channels": f.MultifdChannels}, nil, true
	case "migrate-set-parameters":
		return f.setMultifdChannels(cmd)
	case "cont":
		if f.status == "finish-migrate" {
			return nil, genericError("Migration is not finalized yet"), true
		}
		return nil, nil, false
	case "migrate_cancel":
		if f.migration == "active" && f.LieGrow {
			// As QEMU: "cancelling" until the writer has seen it and
			// stopped, so that no write lands after a canceller has seen
			// "cancelled" (and freed the file).
			f.migration = "cancelling"
			f.status = "paused"
			return nil, nil, true
		}
		return nil, nil, false
	case "query-migrate":
		if f.migration == "failed" && f.errorDesc != "" {
			return map[string]any{"status": f.migration, "error-desc": f.errorDesc}, nil, true
		}
		return nil, nil, false
	case "migrate", "migrate-incoming":
		return f.fileMigrate(cmd)
	}
	return nil, nil, false
}

// migrateFileOut writes State into file: page by page at their offsets,
// zero pages left out, with mapped-ram; in one piece without.
func (f *FakeQEMU) migrateFileOut(file *os.File, mapped bool) {
	defer f.done.Done()
	f.mu.Lock()
	state, failDesc := f.State, f.FileErrorDesc
	f.mu.Unlock()
	var err error
	if f.LieGrow {
		f.growWithoutEnd(file)
		return
	}
	if failDesc != "" {
		_, _ = file.WriteAt(state[:len(state)/2], 0)
	} else if mapped {
		const page = 4096
		var zero [page]byte
		for off := 0; off < len(state) && err == nil; off += page {
			p := state[off:min(off+page, len(state))]
			if !bytes.Equal(p, zero[:len(p)]) {
				_, err = file.WriteAt(p, int64(off))
			}
		}
		if err == nil {
			err = file.Truncate(max(int64(len(state)), f.LieSparseSize))
		}
	} else {
		_, err = file.WriteAt(state, 0)
	}
	f.mu.Lock()
	if err != nil || failDesc != "" {
		f.status = "paused"
		f.migration = "failed"
		f.errorDesc = failDesc
		if err != nil {
			f.errorDesc = err.Error()
		}
		f.mu.Unlock()
		f.event("failed")
		return
	}
	if fi, err := file.Stat(); err == nil {
		f.FileSize = fi.Size()
		f.FileAllocated = allocated(fi)
	}
	// As QEMU does, the event comes a moment before the run state leaves
	// finish-migrate, and cont is refused until then.
	f.status = "finish-migrate"
	f.migration = "completed"
	f.mu.Unlock()
	f.event("completed")
	time.Sleep(finalizeDelay)
	f.mu.Lock()
	f.status = "postmigrate"
	f.mu.Unlock()
}

// lieGrowLimit stops LieGrow's writer if nothing else does, so that a
// test whose bound fails does not fill the disk.
const lieGrowLimit = 4 << 30

// growWithoutEnd is LieGrow's migration: it writes until the migration is
// cancelled (then it ends as QEMU does, with a "cancelled" event) or a
// write fails.
func (f *FakeQEMU) growWithoutEnd(file *os.File) {
	block := bytes.Repeat([]byte{0xa5}, 1<<20)
	for off := int64(0); off < lieGrowLimit; off += int64(len(block)) {
		f.mu.Lock()
		cancelled := f.migration != "active"
		if cancelled {
			f.migration = "cancelled"
		}
		f.mu.Unlock()
		if cancelled {
			f.event("cancelled")
			return
		}
		if _, err := file.WriteAt(block, off); err != nil {
			break
		}
		if fi, err := file.Stat(); err == nil {
			f.mu.Lock()
			f.FileMaxSize = max(f.FileMaxSize, fi.Size())
			f.FileMaxAllocated = max(f.FileMaxAllocated, allocated(fi))
			f.mu.Unlock()
		}
	}
	f.mu.Lock()
	f.status, f.migration, f.errorDesc = "paused", "failed", "the fake stopped writing"
	f.mu.Unlock()
	f.event("failed")
}

// finalizeDelay is how long an outgoing file migration stays in the
// finish-migrate run state after its "completed" event.
const finalizeDelay = 100 * time.Millisecond

// migrateFileIn reads file from its start and loads it if it is State.
func (f *FakeQEMU) migrateFileIn(file *os.File) {
	defer f.done.Done()
	got, _ := io.ReadAll(io.NewSectionReader(file, 0, 1<<40))
	f.load(got)
}

// allocated is the bytes a file takes on disk.
func allocated(fi os.FileInfo) int64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Blocks * 512
	}
	return 0
}
