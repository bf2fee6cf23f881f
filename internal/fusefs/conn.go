package fusefs

import (
	"context"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// State is what a server needs from a connection's INIT to serve it: a
// server that adopts an initialized connection (Resume) gets it from the
// server that did the INIT, persisted beside the descriptor.
type State struct {
	Minor       uint32 `json:"minor"`       // the negotiated protocol minor
	KernelFlags uint64 `json:"kernelFlags"` // what the kernel offered
	Flags       uint64 `json:"flags"`       // what was agreed
}

// ResendSupported says whether the kernel can queue again the requests a dead
// server had read (FUSE_NOTIFY_RESEND, Linux 6.9 and later).
func (s State) ResendSupported() bool { return s.KernelFlags&initHasResend != 0 }

// Conn is one FUSE connection: a /dev/fuse descriptor past INIT. The
// descriptor stays the caller's to close, after Serve has returned.
type Conn struct {
	fd     int
	state  State
	resent bool
	// directIOOnWrite answers write opens with FOPEN_DIRECT_IO. Only the
	// test that shows what the attack suite catches turns it off.
	directIOOnWrite bool
}

// Accept does the INIT of a new connection on fd (from Mount) and returns
// it ready to serve. It waits for the kernel's INIT, which the mount queued,
// or for ctx.
func Accept(ctx context.Context, fd int) (*Conn, error) {
	c := &Conn{fd: fd, directIOOnWrite: true}
	if err := unix.SetNonblock(fd, true); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "FUSE descriptor %d", fd)
	}
	wake, release, err := wakeOn(ctx)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "FUSE INIT")
	}
	defer release()
	buf := make([]byte, bufSize)
	n, err := c.read(ctx, buf, wake)
	if err != nil {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return nil, errcode.Wrap(errcode.Internal, err, "waiting for the kernel's FUSE INIT")
	}
	r, err := parseRequest(buf[:n])
	if err == nil && r.op != opInit {
		err = fmt.Errorf("the first request is opcode %d, not INIT: the connection is initialized already (Resume it)", r.op)
	}
	if err != nil {
		if r.unique != 0 {
			c.write(errMessage(r.unique, unix.EIO))
		}
		return nil, errcode.Wrap(errcode.Internal, err, "FUSE INIT")
	}
	reply, st, err := initReply(r)
	if werr := c.write(reply); err == nil && werr != nil {
		err = errcode.Wrap(errcode.Internal, werr, "answering FUSE INIT")
	}
	if err != nil {
		return nil, err
	}
	c.state = st
	return c, nil
}

// initReply negotiates: the kernel's minor or ours, whichever is older, and
// of the flags we want those the kernel offers.
func initReply(r request) ([]byte, State, error) {
	in, err := r.initIn()
	if err == nil && (in.major != kernelMajor || in.minor < minMinor) {
		err = fmt.Errorf("the kernel speaks FUSE %d.%d; vmsnap needs %d.%d or later", in.major, in.minor, kernelMajor, minMinor)
	}
	if err != nil {
		return errMessage(r.unique, unix.EPROTO), State{}, errcode.Wrap(errcode.Internal, err, "FUSE INIT")
	}
	st := State{Minor: min(in.minor, ourMinor), KernelFlags: in.flags, Flags: in.flags & wantedFlags}
	m := outMessage(r.unique, 0, initOutSize)
	b := m[outHeaderSize:]
	flags := uint32(st.Flags)
	if st.Minor >= 36 && st.Flags>>32 != 0 {
		flags |= initExt
		le.PutUint32(b[32:], uint32(st.Flags>>32))
	}
	le.PutUint32(b[0:], kernelMajor)
	le.PutUint32(b[4:], st.Minor)
	le.PutUint32(b[8:], min(in.maxReadahead, MaxRead))
	le.PutUint32(b[12:], flags)
	le.PutUint32(b[20:], maxWrite)
	le.PutUint32(b[24:], 1) // time_gran
	le.PutUint16(b[28:], maxPages)
	return m, st, nil
}

// Resume adopts fd, a connection whose INIT another server did (st is what
// that server's Accept returned). It first asks the kernel to send again the
// requests the previous server had read but not answered; Resent reports
// whether it could (the kernel may be older than 6.9, and then those
// requests stay unanswered, their readers blocked).
func Resume(fd int, st State) (*Conn, error) {
	if st.Minor < minMinor || st.Minor > ourMinor {
		return nil, errcode.New(errcode.InvalidInput, "FUSE state has protocol minor %d, this server speaks 7.%d to 7.%d: serve the connection with the vmsnap that initialized it", st.Minor, minMinor, ourMinor)
	}
	c := &Conn{fd: fd, state: st, directIOOnWrite: true}
	if err := unix.SetNonblock(fd, true); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "FUSE descriptor %d", fd)
	}
	if st.ResendSupported() {
		err := c.Resend()
		if err != nil && !errors.Is(err, unix.EINVAL) {
			return nil, err
		}
		c.resent = err == nil
	}
	return c, nil
}

// State is the connection's negotiated state, to persist for Resume.
func (c *Conn) State() State { return c.state }

// Resent says whether Resume had the kernel queue the unanswered requests again.
func (c *Conn) Resent() bool { return c.resent }

// Resend writes FUSE_NOTIFY_RESEND: the kernel queues again every request
// that a server read and did not answer (with the unique's top bit set).
func (c *Conn) Resend() error {
	if err := c.write(outMessage(0, notifyResend, 0)); err != nil {
		return errcode.Wrap(errcode.Internal, err, "FUSE_NOTIFY_RESEND (needs Linux 6.9 or later)")
	}
	return nil
}

// InvalidateInode drops the kernel's cached pages of node in [off, off+length)
// (length 0: to the end) and its attributes. A node the kernel does not
// hold is no error.
func (c *Conn) InvalidateInode(node uint64, off, length int64) error {
	m := outMessage(0, notifyInvalInode, 24)
	le.PutUint64(m[16:], node)
	le.PutUint64(m[24:], uint64(off))
	le.PutUint64(m[32:], uint64(length))
	if err := c.write(m); err != nil && !errors.Is(err, unix.ENOENT) {
		return errcode.Wrap(errcode.Internal, err, "FUSE_NOTIFY_INVAL_INODE of node %d", node)
	}
	return nil
}

// errMessage is a reply that carries only an error.
func errMessage(unique uint64, errno unix.Errno) []byte {
	return outMessage(unique, -int32(errno), 0)
}
