package mounter

import (
	"encoding/json"
	"io"
	"net"
	"os"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Requests and responses are SOCK_SEQPACKET messages: the kernel keeps
// their boundaries, so a message is read whole or known to be too long
// (MSG_TRUNC), and a descriptor travels with the one message it belongs to.

// send writes v as one message, with f's descriptor attached when f is not
// nil.
func send(c *net.UnixConn, v any, f *os.File) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if len(b) > MaxMessage {
		return errcode.New(errcode.InvalidInput, "a mounter message of %d bytes is over the protocol's %d", len(b), MaxMessage)
	}
	var oob []byte
	if f != nil {
		oob = unix.UnixRights(int(f.Fd()))
	}
	_, _, err = c.WriteMsgUnix(b, oob, nil)
	return err
}

// recv reads one message of at most MaxMessage bytes into v, and the one
// descriptor it may carry. A longer message, or one with more than one
// descriptor, is refused (the kernel discards what did not fit, and any
// descriptor that did is closed here).
func recv(c *net.UnixConn, v any) (*os.File, error) {
	buf := make([]byte, MaxMessage+1)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, err
	}
	f, ferr := oneFile(oob[:oobn])
	switch {
	case ferr != nil:
	case n == 0:
		ferr = io.EOF
	case n > MaxMessage || flags&unix.MSG_TRUNC != 0:
		ferr = errcode.New(errcode.InvalidInput, "a mounter message is over the protocol's %d bytes", MaxMessage)
	case flags&unix.MSG_CTRUNC != 0:
		ferr = errcode.New(errcode.InvalidInput, "a mounter message carries more than one descriptor")
	default:
		if err := json.Unmarshal(buf[:n], v); err != nil {
			ferr = errcode.Wrap(errcode.InvalidInput, err, "a mounter message is not the protocol's JSON")
		}
	}
	if ferr != nil {
		if f != nil {
			f.Close()
		}
		return nil, ferr
	}
	return f, nil
}

// oneFile is the descriptor in a message's control data, if any.
func oneFile(oob []byte) (*os.File, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "a mounter message has unreadable control data")
	}
	var fds []int
	for i := range msgs {
		got, err := unix.ParseUnixRights(&msgs[i])
		if err == nil {
			fds = append(fds, got...)
		}
	}
	if len(fds) != 1 {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return nil, errcode.New(errcode.InvalidInput, "a mounter message carries %d descriptors, not one", len(fds))
	}
	return os.NewFile(uintptr(fds[0]), "passed descriptor"), nil
}

// versionError refuses a message of another protocol version.
func versionError(got int) error {
	return errcode.New(errcode.InvalidInput, "mounter protocol version %d, this side speaks %d: run the agent and the mounter of one release", got, Version)
}
