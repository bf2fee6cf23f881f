package fusefs

import (
	"context"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func u32Body(v uint32) []byte {
	b := make([]byte, 8)
	le.PutUint32(b, v)
	return b
}

func readBody(off uint64, size uint32) []byte {
	b := make([]byte, 40)
	le.PutUint64(b[8:], off)
	le.PutUint32(b[16:], size)
	return b
}

// TestOpenFlags: any access mode opens, a write open with DIRECT_IO, never
// a truncation; everything with KEEP_CACHE and the stateless handle 0.
func TestOpenFlags(t *testing.T) {
	tree, _ := newTestTree(t)
	k := serveFake(t, tree)
	for _, c := range []struct {
		node  uint64
		flags uint32
		errno unix.Errno
		open  uint32
	}{
		{nodeRAM, unix.O_RDONLY, 0, fopenKeepCache},
		{nodeRAM, unix.O_RDWR, 0, fopenKeepCache | fopenDirectIO},
		{nodeRAM, unix.O_WRONLY, 0, fopenKeepCache | fopenDirectIO},
		{nodeRAM, unix.O_RDONLY | unix.O_TRUNC, unix.EPERM, 0},
		{nodeRAM, unix.O_RDWR | unix.O_TRUNC, unix.EPERM, 0},
		{nodeVol, unix.O_RDONLY, unix.EISDIR, 0},
		{99, unix.O_RDONLY, unix.ENOENT, 0},
	} {
		errno, out := k.call(opOpen, c.node, 0, u32Body(c.flags))
		if errno != c.errno || (errno == 0 && (le.Uint64(out) != 0 || le.Uint32(out[8:]) != c.open)) {
			t.Errorf("OPEN node %d flags %#x: %v %x, want %v open flags %#x", c.node, c.flags, errno, out, c.errno, c.open)
		}
	}
}

// TestRefusals: every mutating opcode is refused, and an opcode the server
// does not know is ENOSYS.
func TestRefusals(t *testing.T) {
	tree, _ := newTestTree(t)
	k := serveFake(t, tree)
	for op, want := range refused {
		if errno, _ := k.call(op, nodeRAM, 0, make([]byte, 64)); errno != want {
			t.Errorf("opcode %d: %v, want %v", op, errno, want)
		}
	}
	for _, op := range []uint32{5, 31, 39, 40, 46, 52, 200} {
		if errno, _ := k.call(op, nodeRAM, 0, make([]byte, 64)); errno != unix.ENOSYS {
			t.Errorf("opcode %d: %v, want ENOSYS", op, errno)
		}
	}
}

// TestMalformedRequests are answered, never fatal.
func TestMalformedRequests(t *testing.T) {
	tree, _ := newTestTree(t)
	k := serveFake(t, tree)
	cases := []struct {
		what  string
		op    uint32
		body  []byte
		errno unix.Errno
	}{
		{"LOOKUP without NUL", opLookup, []byte("ram"), unix.ENOENT},
		{"LOOKUP of ..", opLookup, []byte("..\x00"), unix.ENOENT},
		{"READ with a short body", opRead, make([]byte, 8), unix.EIO},
		{"OPEN without flags", opOpen, nil, unix.EIO},
		{"READ past 2^63", opRead, readBody(1<<63, 4096), unix.EINVAL},
	}
	for _, c := range cases {
		node := uint64(nodeRAM)
		if c.op == opLookup {
			node = nodeVol
		}
		if errno, _ := k.call(c.op, node, 0, c.body); errno != c.errno {
			t.Errorf("%s: %v, want %v", c.what, errno, c.errno)
		}
	}
	// a header whose length lies: answered EIO by its unique
	k.unique += 2
	b := make([]byte, inHeaderSize)
	le.PutUint32(b[0:], 4096)
	le.PutUint32(b[4:], opGetattr)
	le.PutUint64(b[8:], k.unique)
	unix.Write(k.fd, b)
	if errno, _ := k.reply(k.unique); errno != unix.EIO {
		t.Errorf("a lying header: %v, want EIO", errno)
	}
	if errno, _ := k.call(opGetattr, nodeRAM, 0, make([]byte, 16)); errno != 0 {
		t.Errorf("GETATTR after the malformed ones: %v", errno)
	}
}

// panicTree panics in Lookup.
type panicTree struct{ *testTree }

func (panicTree) Lookup(uint64, string) (Attr, error) { panic("a bug in the tree") }

// TestAPanicIsEIO: a handler that panics answers EIO and the server goes on.
func TestAPanicIsEIO(t *testing.T) {
	tree, _ := newTestTree(t)
	k := serveFake(t, panicTree{tree})
	for range 2 {
		if errno, _ := k.call(opLookup, nodeVol, 0, []byte("ram\x00")); errno != unix.EIO {
			t.Fatalf("LOOKUP with a panicking tree: %v, want EIO", errno)
		}
	}
	if errno, out := k.call(opRead, nodeRAM, 0, readBody(0, 4096)); errno != 0 || len(out) != 4096 {
		t.Fatalf("READ after the panics: %v, %d bytes", errno, len(out))
	}
}

// TestReadIsBounded: a READ larger than MaxRead gets MaxRead at most, and
// one at the end of the file gets what is left. (Dispatched directly: a
// reply of a MiB does not fit a socket's message.)
func TestReadIsBounded(t *testing.T) {
	tree, _ := newTestTree(t)
	s := newServer(tree)
	for _, c := range []struct {
		off  uint64
		size uint32
		want int
	}{{0, 4 << 20, MaxRead}, {fileSize - 100, 4096, 100}, {fileSize + 1, 4096, 0}} {
		m := s.dispatch(context.Background(), request{op: opRead, unique: 2, node: nodeRAM, body: readBody(c.off, c.size)})
		if len(m)-outHeaderSize != c.want || int(le.Uint32(m)) != len(m) || le.Uint32(m[4:]) != 0 {
			t.Errorf("READ of %d at %d: %d bytes, header %x, want %d bytes", c.size, c.off, len(m)-outHeaderSize, m[:outHeaderSize], c.want)
		}
	}
}

// newServer is a server to call dispatch on directly.
func newServer(tree Tree) *server {
	return &server{conn: &Conn{fd: -1, directIOOnWrite: true}, tree: tree, workers: 1,
		inflight: map[uint64]context.CancelCauseFunc{}}
}

// TestStoppingLeavesBlockedReadsUnanswered: a Read still waiting when Serve
// stops is not answered (EINTR would be a SIGBUS in QEMU): the next server
// gets it by RESEND.
func TestStoppingLeavesBlockedReadsUnanswered(t *testing.T) {
	tree, _ := newTestTree(t)
	pending := make(chan struct{}, 1)
	tree.block = func(ctx context.Context, off int64) error {
		pending <- struct{}{}
		<-ctx.Done()
		return ctx.Err()
	}
	k, fd := newFakeKernel(t)
	c, _, err := k.accept(fd, 45, 1<<44-1)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- c.Serve(ctx, tree) }()
	k.send(opRead, nodeRAM, 0, readBody(0, 4096))
	<-pending
	cancel()
	select {
	case <-served:
	case <-time.After(2 * time.Minute):
		t.Fatal("Serve did not return after its context ended")
	}
	unix.SetNonblock(k.fd, true)
	if n, err := unix.Read(k.fd, make([]byte, 64)); err != unix.EAGAIN {
		t.Fatalf("the stopped server answered the blocked READ (%d bytes, %v)", n, err)
	}
}

// TestRootIsRootsOnly: the root is 0700 root's.
func TestRootIsRootsOnly(t *testing.T) {
	tree, _ := newTestTree(t)
	k := serveFake(t, tree)
	if errno, _ := k.call(opLookup, rootNode, 1000, []byte("p\x00")); errno != unix.EACCES {
		t.Errorf("LOOKUP in the root by uid 1000: %v, want EACCES", errno)
	}
	if errno, _ := k.call(opOpendir, rootNode, 1000, make([]byte, 8)); errno != unix.EACCES {
		t.Errorf("OPENDIR of the root by uid 1000: %v, want EACCES", errno)
	}
	if errno, out := k.call(opLookup, rootNode, 0, []byte("p\x00")); errno != 0 || le.Uint64(out[16:]) != 0 {
		t.Errorf("LOOKUP in the root by root: %v, entry valid %d s (must be 0)", errno, le.Uint64(out[16:]))
	}
	if errno, _ := k.call(opLookup, nodeP, 1000, []byte("vol\x00")); errno != 0 {
		t.Errorf("LOOKUP below the root by uid 1000: %v", errno)
	}
}

// shortTree returns half of what is asked.
type shortTree struct{ *testTree }

func (s shortTree) Read(ctx context.Context, node uint64, dst []byte, off int64) (int, error) {
	n, err := s.testTree.Read(ctx, node, dst[:len(dst)/2], off)
	return n, err
}

// TestAShortReadIsEIO: bytes a tree does not deliver are an error, never
// the zeros the kernel would put in their place.
func TestAShortReadIsEIO(t *testing.T) {
	tree, _ := newTestTree(t)
	s := newServer(shortTree{tree})
	m := s.dispatch(context.Background(), request{op: opRead, unique: 2, node: nodeRAM, body: readBody(0, 4096)})
	if errno := unix.Errno(-int32(le.Uint32(m[4:]))); errno != unix.EIO || len(m) != outHeaderSize {
		t.Fatalf("a short Read answered %v with %d bytes, want EIO", errno, len(m)-outHeaderSize)
	}
}
