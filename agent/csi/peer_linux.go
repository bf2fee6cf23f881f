package csi

import (
	"net"

	"golang.org/x/sys/unix"
)

// rootPeersOnly accepts connections from uid 0 only. The socket's mode
// (0600 root) is the first gate; the kernel's record of the peer is the
// second, for a socket whose mode someone loosened. Others are closed at
// accept, before gRPC reads a byte.
type rootPeersOnly struct{ *net.UnixListener }

func (l rootPeersOnly) Accept() (net.Conn, error) {
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			return nil, err
		}
		if peerIsRoot(c) {
			return c, nil
		}
		c.Close()
	}
}

func peerIsRoot(c *net.UnixConn) bool {
	raw, err := c.SyscallConn()
	if err != nil {
		return false
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil || cerr != nil {
		return false
	}
	return cred.Uid == 0
}
