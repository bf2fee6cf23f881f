package vmstate

import (
	"context"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// stagingFile is an unlinked file in a staging directory that QEMU gets a
// descriptor of (a mapped-ram file: QEMU writes it on a checkpoint, reads
// it on a restore). QEMU may be someone else's, so the file is guarded
// from the moment it exists until nobody but vmsnap holds it any more:
//
//   - it is bounded by maxStateBytes of the VM's memory, the bound its
//     operation reserved (reserveStaging): past it, the file is emptied
//     and the operation aborted;
//   - when the operation ends (settle), QEMU must have closed its
//     descriptor. The kernel says whether anyone else still holds the file
//     (a lease on our read-only descriptor, granted only then): not a pid,
//     so a descriptor QEMU passed on to another process counts too. One
//     that does not let go fails the operation, and the file is kept empty
//     (any byte is too many now) until the last descriptor is closed.
type stagingFile struct {
	dir     string
	mon     Monitor
	memory  int64       // the VM's: the file's bound is maxStateBytes(memory)
	owner   string      // whose operation (maxKeptStaging)
	abort   func(error) // called once, when the bound is passed
	release func()      // of the space reservation

	mu      sync.Mutex
	f       *os.File // ours, read-write, until settle: truncating it frees the space
	ro      *os.File // ours, read-only, until nobody else holds the file
	qemu    *os.File // QEMU's, until it is passed
	fdset   int64
	held    bool  // QEMU holds fdset
	settled bool  // the operation ended: the file must stay empty
	err     error // the bound passed during the operation
	kept    bool  // counted in stagingSpace.kept
}

// stagingGuardInterval is how often a staging file is checked against its
// bound: what QEMU can write in one interval past the bound is what gets
// through (at 2 GB/s, 100 MB).
var stagingGuardInterval = 50 * time.Millisecond

// newStagingFile reserves maxStateBytes(memory) in dir and creates an empty
// file there, unlinked before this returns: it goes with the last
// descriptor, whatever happens. QEMU's descriptor is open with flag
// (os.O_WRONLY for its outgoing side, os.O_RDONLY for its incoming side:
// QEMU's fdset matches the access mode), in an operation for owner. abort is called, once, if the file
// passes its bound. Settle it once the operation is over.
func newStagingFile(dir string, flag int, mon Monitor, memory int64, owner string, abort func(error)) (*stagingFile, error) {
	release, err := reserveStaging(dir, maxStateBytes(memory), true, owner)
	if err != nil {
		return nil, err
	}
	s := &stagingFile{dir: dir, mon: mon, memory: memory, owner: owner, abort: abort, release: release}
	if err := s.create(flag); err != nil {
		s.closeAll()
		release()
		return nil, err
	}
	go s.guard()
	return s, nil
}

// create makes the file and opens our descriptors and QEMU's.
func (s *stagingFile) create(flag int) error {
	rw, err := os.CreateTemp(s.dir, ".vmsnap-state-*.tmp") // O_RDWR
	if err != nil {
		return stagingError(s.dir, err, "creating the staging file")
	}
	s.f = rw
	name := rw.Name()
	defer os.Remove(name)
	if s.ro, err = os.Open(name); err != nil {
		return stagingError(s.dir, err, "opening the staging file")
	}
	if s.qemu, err = os.OpenFile(name, flag, 0); err != nil {
		return stagingError(s.dir, err, "opening the staging file")
	}
	if err := os.Remove(name); err != nil {
		return stagingError(s.dir, err, "unlinking the staging file")
	}
	return nil
}

// file is our read-write descriptor, for the operation's own reads and
// writes; nil once settled.
func (s *stagingFile) file() *os.File { return s.f }

// pass hands QEMU its descriptor in a new fdset (add-fd over SCM_RIGHTS):
// "file:/dev/fdset/ID" (uri) then opens a duplicate of it.
func (s *stagingFile) pass(ctx context.Context) error {
	var r struct {
		FDSetID int64 `json:"fdset-id"`
	}
	err := s.mon.ExecuteWithFile(ctx, "add-fd", map[string]any{"opaque": "vmsnap staging file"}, &r, s.qemu)
	s.mu.Lock()
	s.qemu.Close() // QEMU holds its own copy now
	s.qemu = nil
	if err == nil {
		s.fdset, s.held = r.FDSetID, true
	}
	s.mu.Unlock()
	return errcode.Ensure(errcode.QMPError, err, "passing the staging file to QEMU")
}

func (s *stagingFile) uri() string { return "file:/dev/fdset/" + strconv.FormatInt(s.fdset, 10) }

// free frees the file's space at once, once QEMU is done with it:
// truncating it frees the blocks whatever descriptors QEMU still holds.
func (s *stagingFile) free() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.truncate()
}

// truncate empties the file: through our read-write descriptor while we
// hold one, else through a read-write reopen of our read-only one, closed
// at once (it would count as a holder). The caller holds s.mu.
func (s *stagingFile) truncate() {
	if s.f != nil {
		_ = s.f.Truncate(0)
		return
	}
	if s.ro == nil {
		return
	}
	if w, err := os.OpenFile("/proc/self/fd/"+strconv.Itoa(int(s.ro.Fd())), os.O_WRONLY, 0); err == nil {
		_ = w.Truncate(0)
		w.Close()
	}
}

// dropFDSet drops QEMU's fdset (best effort, with its own budget: QEMU
// only holds a file that is unlinked and, once freed, empty).
func (s *stagingFile) dropFDSet(ctx context.Context) {
	s.mu.Lock()
	held := s.held
	s.held = false
	s.mu.Unlock()
	if !held {
		return
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = s.mon.Execute(cctx, "remove-fd", map[string]any{"fdset-id": s.fdset}, nil)
}

// exceeded is the error of the bound passed during the operation, or nil.
func (s *stagingFile) exceeded() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// qemuFull is QEMU's failure to write the file for want of space (errno
// ENOSPC or EDQUOT), as an error of ours that names it.
func (s *stagingFile) qemuFull(errno syscall.Errno) error {
	return stagingError(s.dir, &os.PathError{Op: "write", Path: ".vmsnap-state-*.tmp", Err: errno}, "QEMU writing the VM state")
}

// stagingError is INTERNAL and names the directory to change; a full disk
// gets errcode.Wrap's advice (free space there).
func stagingError(dir string, err error, what string) error {
	return errcode.Wrap(errcode.Internal, err, "%s in the staging directory %s (pick another with %s)", what, dir, errcode.Field("stagingDir"))
}
