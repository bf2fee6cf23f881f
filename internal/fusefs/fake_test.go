package fusefs

import (
	"context"
	"errors"
	"testing"

	"golang.org/x/sys/unix"
)

// fakeKernel is the kernel's end of a SOCK_SEQPACKET pair: it keeps message
// boundaries as /dev/fuse does, so the server runs unchanged on the other end.
type fakeKernel struct {
	t      *testing.T
	fd     int
	unique uint64
}

// newFakeKernel returns the kernel's end and the server's descriptor.
func newFakeKernel(t *testing.T) (*fakeKernel, int) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fds[0]); unix.Close(fds[1]) })
	return &fakeKernel{t: t, fd: fds[0]}, fds[1]
}

// send writes a request and returns its unique.
func (k *fakeKernel) send(op uint32, node uint64, uid uint32, body []byte) uint64 {
	k.unique += 2
	b := make([]byte, inHeaderSize+len(body))
	le.PutUint32(b[0:], uint32(len(b)))
	le.PutUint32(b[4:], op)
	le.PutUint64(b[8:], k.unique)
	le.PutUint64(b[16:], node)
	le.PutUint32(b[24:], uid)
	copy(b[inHeaderSize:], body)
	if _, err := unix.Write(k.fd, b); err != nil {
		k.t.Fatal(err)
	}
	return k.unique
}

// reply reads one reply and checks its header.
func (k *fakeKernel) reply(unique uint64) (unix.Errno, []byte) {
	k.t.Helper()
	b := make([]byte, 2<<20)
	n, err := unix.Read(k.fd, b)
	if err != nil {
		k.t.Fatal(err)
	}
	b = b[:n]
	if n < outHeaderSize || int(le.Uint32(b)) != n || le.Uint64(b[8:]) != unique {
		k.t.Fatalf("reply header %x for unique %d", b[:min(n, outHeaderSize)], unique)
	}
	return unix.Errno(-int32(le.Uint32(b[4:]))), b[outHeaderSize:]
}

func (k *fakeKernel) call(op uint32, node uint64, uid uint32, body []byte) (unix.Errno, []byte) {
	k.t.Helper()
	return k.reply(k.send(op, node, uid, body))
}

// initBody is a kernel's fuse_init_in offering flags at minor.
func initBody(minor uint32, flags uint64) []byte {
	b := make([]byte, 64)
	le.PutUint32(b[0:], 7)
	le.PutUint32(b[4:], minor)
	le.PutUint32(b[8:], 4<<20)
	le.PutUint32(b[12:], uint32(flags)|initExt)
	le.PutUint32(b[16:], uint32(flags>>32))
	return b
}

// accept runs Accept against the fake kernel's INIT and returns the
// connection and the INIT reply's payload.
func (k *fakeKernel) accept(fd int, minor uint32, flags uint64) (*Conn, []byte, error) {
	unique := k.send(opInit, 0, 0, initBody(minor, flags))
	type result struct {
		c   *Conn
		err error
	}
	done := make(chan result, 1)
	go func() { c, err := Accept(context.Background(), fd); done <- result{c, err} }()
	errno, out := k.reply(unique)
	r := <-done
	if errno != 0 && r.err == nil {
		k.t.Fatalf("INIT answered %v but Accept succeeded", errno)
	}
	return r.c, out, r.err
}

// serveFake accepts a connection offering every flag there is and serves tree.
func serveFake(t *testing.T, tree Tree) *fakeKernel {
	k, fd := newFakeKernel(t)
	c, _, err := k.accept(fd, 45, 1<<44-1)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- c.Serve(ctx, tree) }()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("Serve: %v", err)
		}
	})
	return k
}
