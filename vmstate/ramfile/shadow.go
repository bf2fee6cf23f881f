package ramfile

import (
	"math/bits"
	"os"
	"slices"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Shadow builds a Capture from a RAM file's pages as a pre-copy migration
// sends them while the VM runs: every page at least once, a page the guest
// wrote meanwhile again later, the last copy counting. It keeps, in an
// unlinked staging file at each page's own offset, only the pages whose
// latest copy differs from the parent's (every data page, for a base): an
// idle VM's pre-copy writes next to nothing. A parent to verify
// (Parent.Verify) costs a SHA-256 of each copy whose fast hash matches its
// map. Memory is a few bits per page and a hash per data page in a map (about 36 bytes each: it follows the
// guest's data, as the page map does, not its size).
//
// Page and Zero are called from one goroutine, in stream order; Capture
// once the migration has completed.
type Shadow struct {
	size   int64
	pages  int
	parent *Parent
	dir    string
	file   *os.File

	seen    []uint64          // QEMU sent the page at least once
	kept    []uint64          // the staging file holds the page's latest copy
	refuted []uint64          // the latest copy matched the parent's fast hash, not its strong one
	hash    map[uint32]uint64 // the fast hash of each data page's latest copy

	run   []byte // consecutive kept pages not written yet
	runAt int    // the first of them

	received, written int64
}

// shadowRun is how much Shadow gathers before a write.
const shadowRun = 1 << 20

// NewShadow readies a Shadow for a RAM file of size bytes whose parent is
// parent (nil for a base), staging in stagingDir.
func NewShadow(size int64, parent *Parent, stagingDir string) (*Shadow, error) {
	if err := CheckSize(size); err != nil {
		return nil, err
	}
	pages := Pages(size)
	if err := parent.check(pages); err != nil {
		return nil, err
	}
	f, err := os.CreateTemp(stagingDir, ".vmsnap-ram-*.tmp")
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "creating the RAM staging file in %s (pick another with %s)", stagingDir, errcode.Field("stagingDir"))
	}
	os.Remove(f.Name())
	words := (pages + 63) / 64
	return &Shadow{
		size: size, pages: pages, parent: parent, dir: stagingDir, file: f,
		seen: make([]uint64, words), kept: make([]uint64, words), refuted: make([]uint64, words), hash: map[uint32]uint64{},
		run: make([]byte, 0, shadowRun),
	}, nil
}

// Close frees the staging file (a no-op once Capture has taken it).
func (s *Shadow) Close() {
	if s.file != nil {
		_ = s.file.Truncate(0)
		s.file.Close()
		s.file = nil
	}
}

func (s *Shadow) check(i int) error {
	if i < 0 || i >= s.pages {
		return errcode.New(errcode.QMPError, "QEMU's migration names RAM page %d of a %d-page RAM file", i, s.pages)
	}
	return nil
}

// Page takes page i's content, PageSize bytes.
func (s *Shadow) Page(i int, p []byte) error {
	if err := s.check(i); err != nil {
		return err
	}
	s.received += PageSize
	s.seen[i/64] |= 1 << (i % 64)
	h := fastHash(p)
	if h == 0 {
		s.zero(i)
		return nil
	}
	s.hash[uint32(i)] = h
	same, refuted := s.parent.unchanged(i, h, p)
	setBit(s.refuted, i, refuted)
	if same {
		s.kept[i/64] &^= 1 << (i % 64) // as the parent had it
		return nil
	}
	s.kept[i/64] |= 1 << (i % 64)
	if len(s.run) > 0 && (i != s.runAt+len(s.run)/PageSize || len(s.run) == cap(s.run)) {
		if err := s.flush(); err != nil {
			return err
		}
	}
	if len(s.run) == 0 {
		s.runAt = i
	}
	s.run = append(s.run, p[:PageSize]...)
	return nil
}

// Zero takes page i as a page of zeros.
func (s *Shadow) Zero(i int) error {
	if err := s.check(i); err != nil {
		return err
	}
	s.seen[i/64] |= 1 << (i % 64)
	s.zero(i)
	return nil
}

func (s *Shadow) zero(i int) {
	delete(s.hash, uint32(i))
	s.kept[i/64] &^= 1 << (i % 64)
	setBit(s.refuted, i, false)
}

func setBit(bits []uint64, i int, on bool) {
	if on {
		bits[i/64] |= 1 << (i % 64)
	} else {
		bits[i/64] &^= 1 << (i % 64)
	}
}

// flush writes the run at its pages' offsets. A page in it that was
// zeroed or reverted since is written too, but no longer kept: nothing
// reads it.
func (s *Shadow) flush() error {
	if len(s.run) == 0 {
		return nil
	}
	if _, err := s.file.WriteAt(s.run, int64(s.runAt)*PageSize); err != nil {
		return stagingErr(s.dir, err)
	}
	s.written += int64(len(s.run))
	s.run = s.run[:0]
	return nil
}

// FillUnsent reads the pages QEMU never sent from f, the RAM file, which
// must not change meanwhile (the VM is stopped): a balloon's free-page
// hints make QEMU skip pages the guest said it does not use, which hold
// whatever they hold all the same. It returns how many it read.
func (s *Shadow) FillUnsent(f *os.File) (int, error) {
	unsent := s.unsent(-1)
	page := make([]byte, PageSize)
	for _, i := range unsent {
		if _, err := f.ReadAt(page, int64(i)*PageSize); err != nil {
			return 0, errcode.Wrap(errcode.Internal, err, "reading page %d of the RAM file, which QEMU did not send", i)
		}
		if err := s.Page(i, page); err != nil {
			return 0, err
		}
		s.received -= PageSize // read, not received
	}
	return len(unsent), nil
}

// unsent lists the pages QEMU has not sent, ascending: at most max of
// them (all with max < 0).
func (s *Shadow) unsent(max int) []int {
	var out []int
	for w, b := range s.seen {
		want := ^uint64(0)
		if rest := s.pages - w*64; rest < 64 {
			want = 1<<rest - 1
		}
		for missing := ^b & want; missing != 0 && len(out) != max; missing &= missing - 1 {
			out = append(out, w*64+bits.TrailingZeros64(missing))
		}
	}
	return out
}

// Capture is the RAM file as the last copy of each page gives it. QEMU
// must have sent every page (or FillUnsent read it): one it never sent
// would hold whatever the file held, which no pre-copy saw.
func (s *Shadow) Capture() (*Capture, error) {
	if err := s.flush(); err != nil {
		return nil, err
	}
	if unsent := s.unsent(1); len(unsent) > 0 {
		return nil, errcode.New(errcode.QMPError, "QEMU's migration left page %d of the RAM file unsent", unsent[0])
	}
	c := &Capture{Size: s.size, Map: newPageMap(s.pages), parent: s.parent, staging: s.file, shadow: true, StagedBytes: s.written, ScannedBytes: s.received}
	keys := make([]uint32, 0, len(s.hash))
	for i := range s.hash {
		keys = append(keys, i)
	}
	slices.Sort(keys)
	for _, i := range keys {
		c.Map.add(int(i), s.hash[i])
		switch {
		case s.refuted[i/64]&(1<<(i%64)) != 0:
			c.refute(int(i))
		case s.parent != nil && s.parent.Map.Fast(int(i)) == s.hash[i]:
			c.Map.strong[len(c.Map.strong)-1] = s.parent.Map.Strong(int(i))
		}
	}
	c.Map.finish()
	c.diff()
	for _, i := range c.changed {
		if !c.Map.IsZero(int(i)) && s.kept[i/64]&(1<<(i%64)) == 0 {
			return nil, errcode.New(errcode.Internal, "RAM page %d changed but its copy was not kept", i)
		}
	}
	s.file = nil // the capture's now
	return c, nil
}
