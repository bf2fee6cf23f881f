package mounter

import (
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// fdStore keeps a duplicate of the node's /dev/fuse descriptor: while
// either the agent or the mounter holds one, the FUSE connection lives,
// so either can restart and take it back from the other.
type fdStore struct {
	mu sync.Mutex
	f  *os.File
}

// fuseMajor, fuseMinor: /dev/fuse's device number on every Linux.
const fuseMajor, fuseMinor = 10, 229

// put keeps f, a /dev/fuse descriptor, in place of the one held before
// (the agent hands over the connection it serves; an older one is done).
func (s *fdStore) put(f *os.File) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return errcode.Wrap(errcode.InvalidInput, err, "the descriptor handed to the mounter cannot be examined")
	}
	if st.Mode&unix.S_IFMT != unix.S_IFCHR || unix.Major(st.Rdev) != fuseMajor || unix.Minor(st.Rdev) != fuseMinor {
		return errcode.New(errcode.InvalidInput, "the descriptor handed to the mounter is not /dev/fuse (mode %#o, device %d:%d)",
			st.Mode, unix.Major(st.Rdev), unix.Minor(st.Rdev))
	}
	s.mu.Lock()
	old := s.f
	s.f = f
	s.mu.Unlock()
	if old != nil {
		old.Close()
	}
	return nil
}

// get returns a duplicate of the descriptor held, for the caller to send
// and close; nil when none is held (none was handed over since the
// mounter started).
func (s *fdStore) get() (*os.File, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.f == nil {
		return nil, nil
	}
	fd, err := unix.FcntlInt(s.f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "duplicating the held /dev/fuse descriptor")
	}
	return os.NewFile(uintptr(fd), "/dev/fuse"), nil
}

func (s *fdStore) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.f != nil {
		s.f.Close()
		s.f = nil
	}
}
