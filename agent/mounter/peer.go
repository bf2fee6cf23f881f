package mounter

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// The socket's directory (0700, root) is the first gate; the kernel's
// record of who connected (SO_PEERCRED, taken at connect() and immune to
// what the peer does afterwards) is the second, so that a directory
// someone loosened (a hostPath with the wrong mode) still admits only the
// agent: uid 0 and, when the mounter is given one, the agent's gid.

// admit returns nil for a peer that may use the mounter.
func (s *Server) admit(c *net.UnixConn) error {
	cred, err := peerCred(c)
	if err != nil {
		return errcode.Wrap(errcode.Forbidden, err, "the mounter could not establish who is calling (SO_PEERCRED), so it refuses the call")
	}
	who := fmt.Sprintf("uid %d, gid %d, pid %d", cred.Uid, cred.Gid, cred.Pid)
	if cred.Uid != 0 {
		return errcode.New(errcode.Forbidden, "the mounter serves only the node agent (uid 0); this caller has %s", who)
	}
	if s.cfg.AgentGID >= 0 && cred.Gid != uint32(s.cfg.AgentGID) {
		return errcode.New(errcode.Forbidden, "the mounter serves only the node agent (uid 0, gid %d); this caller has %s", s.cfg.AgentGID, who)
	}
	return nil
}

func peerCred(c *net.UnixConn) (*unix.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var sysErr error
	if err := raw.Control(func(fd uintptr) {
		cred, sysErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, sysErr
}
