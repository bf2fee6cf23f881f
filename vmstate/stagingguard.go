package vmstate

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// guard checks the file every stagingGuardInterval until nobody but vmsnap
// holds it once its operation ended (see stagingFile).
func (s *stagingFile) guard() {
	tick := time.NewTicker(stagingGuardInterval)
	defer tick.Stop()
	for range tick.C {
		if s.check() {
			return
		}
	}
}

// check bounds the file once, and says whether the guard is over: the
// operation ended and nobody else holds the file (then our last
// descriptor is closed).
func (s *stagingFile) check() (over bool) {
	s.mu.Lock()
	var abort func(error)
	defer func() {
		s.mu.Unlock()
		if abort != nil {
			abort(s.err)
		}
	}()
	if s.ro == nil {
		return !s.kept
	}
	size, allocated, err := fileExtent(s.ro)
	limit := maxStateBytes(s.memory)
	if s.settled {
		limit = 0 // QEMU has no business writing any more
	}
	if err == nil && (size > limit || allocated > limit) {
		s.truncate() // again if QEMU goes on: it must not fill the disk meanwhile
		if !s.settled && s.err == nil {
			s.err = stateTooLarge(fmt.Sprintf("grew the staging file to %d MiB", max(size, allocated)>>20), s.memory)
			abort = s.abort
		}
	}
	if !s.settled {
		return false
	}
	held := s.holders() != noHolder
	if held == s.kept {
		return false
	}
	// Counted while kept after its operation (maxKeptStaging).
	s.kept = held
	if held {
		keep(s.owner, 1)
	} else {
		keep(s.owner, -1)
	}
	if held {
		return false
	}
	s.closeAll()
	return true
}

// holder is who else holds a file open.
type holder int

const (
	noHolder holder = iota
	readers         // read-only descriptors only
	writers         // a descriptor open for writing (or the kernel cannot tell)
)

// holders asks the kernel who else holds the file, through a lease on our
// read-only descriptor (the caller holds s.mu, and our read-write one is
// closed: it would count): a write lease is granted only if no other
// descriptor is open on the file, a read lease only if none is open for
// writing. Whose descriptor does not matter: QEMU's, or one it passed on.
// An unexpected error counts as writers, to be safe (a staging directory
// is on a filesystem with leases: checkRoom).
func (s *stagingFile) holders() holder {
	fd := s.ro.Fd()
	for _, try := range []struct {
		lease int
		h     holder
	}{{unix.F_WRLCK, noHolder}, {unix.F_RDLCK, readers}} {
		if _, err := unix.FcntlInt(fd, unix.F_SETLEASE, try.lease); err == nil {
			_, _ = unix.FcntlInt(fd, unix.F_SETLEASE, unix.F_UNLCK)
			return try.h
		} else if !errors.Is(err, unix.EAGAIN) {
			return writers
		}
	}
	return writers
}

// settle ends the operation's use of the file: QEMU's fdset is dropped,
// the file emptied and our read-write descriptor closed, the space
// reservation released. QEMU must then hold no descriptor open for
// writing, unless mayKeep (a QEMU that keeps removed descriptors while the
// VM is stopped: keepsRemovedFDs): otherwise settle fails, QMP_ERROR. A
// file still held, for reading or not, is kept empty by its guard until
// the last descriptor is closed. Calling it again does nothing.
func (s *stagingFile) settle(ctx context.Context, mayKeep bool) error {
	s.dropFDSet(ctx)
	s.mu.Lock()
	if s.settled {
		s.mu.Unlock()
		return nil
	}
	s.settled = true
	s.truncate()
	if s.f != nil {
		s.f.Close()
		s.f = nil
	}
	if s.qemu != nil { // never passed
		s.qemu.Close()
		s.qemu = nil
	}
	h := noHolder
	if s.ro != nil {
		h = s.holders()
	}
	s.mu.Unlock()
	s.release() // empty, and kept so
	if s.check() {
		return nil
	}
	if h == writers && !mayKeep {
		return errcode.New(errcode.QMPError, "QEMU still holds its staging file open for writing after the operation (it did not close it when its fdset was removed): the QEMU is broken or hostile, so the operation failed; vmsnap keeps the file empty until QEMU closes it or exits")
	}
	return nil
}

// closeAll closes our descriptors (the caller holds s.mu, or owns s
// alone).
func (s *stagingFile) closeAll() {
	for _, f := range []**os.File{&s.f, &s.ro, &s.qemu} {
		if *f != nil {
			(*f).Close()
			*f = nil
		}
	}
}

// keepsRemovedFDs says whether a QEMU of this version keeps the
// descriptors of a removed fdset open while its VM is stopped: QEMU 9.0
// closes them only while the VM runs (9.1 and later at remove-fd).
func keepsRemovedFDs(version string) bool { return majorMinor(version) == "9.0" }
