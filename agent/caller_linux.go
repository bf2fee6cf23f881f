//go:build linux

package agent

// Which pod is calling.
//
// The kernel recorded the caller's pid when it connected (SO_PEERCRED,
// translated into the agent's pid namespace; the DaemonSet runs with
// hostPID so that it sees every pod's processes). From that pid:
//
//  1. /proc/PID/cgroup names candidate containers: the innermost path
//     components that are a 64-hex container ID (cgroupfs: .../ID; systemd:
//     cri-containerd-ID.scope).
//  2. The resolver (containerd) loads each candidate and takes the first
//     whose task has the pid among its processes: a cgroup's name alone
//     proves nothing. That container's io.kubernetes.pod.namespace label is
//     the caller's namespace.
//  3. A process in no such container whose pid namespace is the one the
//     agent's /proc shows (the node's, with hostPID) is on the node outside
//     any container: an administrator. A process in a nested pid namespace
//     that matches no container is refused: the agent cannot tell which pod
//     it is. Its pid namespace comes from the NSpid line of
//     /proc/PID/status (one entry: the same namespace), which needs no
//     ptrace access to the process, unlike /proc/PID/ns/pid.
//
// The pid may have been reused between the caller's connect() and these
// reads. So:
//
//   - where the kernel has SO_PEERPIDFD (Linux 6.5), the agent takes, at
//     accept(), a pidfd of the very process that connected, and after all
//     the reads it checks that this process has not exited: the pid was
//     then still its, and everything read about the pid was about it. A
//     kernel that has SO_PEERPIDFD but cannot give one (the caller already
//     exited) refuses the caller;
//   - everywhere, the process at the pid must have started no later than
//     the connection was accepted, and still be the same process (same
//     start time) after the resolver answered. Without SO_PEERPIDFD this is
//     all there is, and what remains is a pid reused between connect() and
//     accept(), the window the peer credential check (peercred.go) leaves
//     too.
//
// A caller whose pid the agent cannot see at all (pid 0: a pid namespace
// the agent does not see) is refused.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// callerConn is an accepted connection with the credentials of whoever
// made it; the caller is established once, at its first request.
type callerConn struct {
	net.Conn
	peer     peer
	accepted time.Time

	once   sync.Once
	caller Caller
	err    error

	mu       sync.Mutex // guards pidfd against Close
	pidfd    int        // of the process that connected; -1: none
	pidfdErr error      // why the kernel gave none, where it could have
}

// newCallerConn wraps c, an accepted unix connection from p.
func newCallerConn(c net.Conn, p peer, accepted time.Time) *callerConn {
	cc := &callerConn{Conn: c, peer: p, accepted: accepted, pidfd: -1}
	cc.pidfd, cc.pidfdErr = peerPidfd(c)
	return cc
}

func (c *callerConn) Close() error {
	c.mu.Lock()
	if c.pidfd >= 0 {
		unix.Close(c.pidfd)
		c.pidfd = -1
	}
	c.mu.Unlock()
	return c.Conn.Close()
}

// CloseWrite half-closes the connection (answerRefused).
func (c *callerConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

func (c *callerConn) identify(ctx context.Context, s *Server) (Caller, error) {
	c.once.Do(func() {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if c.pidfdErr != nil {
			c.err = errcode.Wrap(errcode.Forbidden, c.pidfdErr, "%s: the process that connected is gone", cannotTell)
			return
		}
		c.caller, c.err = placePeer(s, ctx, c.peer, c.accepted)
		if c.err == nil && !c.stillThere() {
			c.caller, c.err = Caller{}, errcode.New(errcode.Forbidden, "%s: the process that connected (pid %d) exited while the agent looked it up", cannotTell, c.peer.pid)
		}
	})
	return c.caller, c.err
}

// stillThere reports whether the process that connected has not exited
// (always true without a pidfd: identifyPeer's start times are all there
// is then). A pidfd polls readable once its process has exited.
func (c *callerConn) stillThere() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pidfd < 0 {
		return c.pidfdErr == nil
	}
	fds := []unix.PollFd{{Fd: int32(c.pidfd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, 0)
		if err == unix.EINTR {
			continue
		}
		return err == nil && n == 0
	}
}

// peerPidfd is a pidfd of the process that connected c (SO_PEERPIDFD),
// or -1 and no error where the kernel has no SO_PEERPIDFD.
func peerPidfd(c net.Conn) (int, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return -1, nil
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd, sysErr := -1, error(nil)
	if err := raw.Control(func(s uintptr) {
		fd, sysErr = unix.GetsockoptInt(int(s), unix.SOL_SOCKET, unix.SO_PEERPIDFD)
	}); err != nil {
		return -1, err
	}
	if errors.Is(sysErr, unix.ENOPROTOOPT) {
		return -1, nil
	}
	if sysErr != nil {
		return -1, fmt.Errorf("SO_PEERPIDFD: %w", sysErr)
	}
	return fd, nil
}

// placePeer places a connection's caller; tests that run callers as child
// processes, in no pod, replace it to place them in one.
var placePeer = (*Server).identifyPeer

const cannotTell = "the agent cannot tell which pod you are, so it refuses the call"

// identifyPeer establishes the caller behind the peer credentials p.
func (s *Server) identifyPeer(ctx context.Context, p peer, accepted time.Time) (Caller, error) {
	if p.pid <= 0 {
		return Caller{}, errcode.New(errcode.Forbidden, "%s: your process is in a pid namespace the agent does not see (run the agent with hostPID)", cannotTell)
	}
	dir := "/proc/" + strconv.Itoa(int(p.pid))
	start, err := procStart(dir)
	if err == nil {
		err = startedBefore(p.pid, start, accepted)
	}
	if err != nil {
		return Caller{}, errcode.Wrap(errcode.Forbidden, err, "%s: the process that connected is gone", cannotTell)
	}
	// The same process (pid and start time) connecting again is the same
	// caller: no containerd lookup per connection of a client, or a flood.
	if c, ok := s.placed.get(p.pid, start); ok {
		return c, nil
	}
	c, err := s.lookupPeer(ctx, p, dir, start)
	if err == nil {
		s.placed.put(p.pid, start, c)
	}
	return c, err
}

// lookupPeer places the process p, which started at start, through its
// cgroups and the resolver.
func (s *Server) lookupPeer(ctx context.Context, p peer, dir string, start time.Duration) (Caller, error) {
	cgroups, err := readSmall(dir + "/cgroup")
	if err != nil {
		return Caller{}, errcode.Wrap(errcode.Forbidden, err, "%s", cannotTell)
	}
	nested, err := inNestedPidNS(dir)
	if err != nil {
		return Caller{}, errcode.Wrap(errcode.Forbidden, err, "%s", cannotTell)
	}
	var found CallerContainer
	var ok bool
	if ids := cgroupContainerIDs(cgroups); len(ids) > 0 {
		if idf, has := s.cfg.Resolver.(CallerIdentifier); has {
			if found, ok, err = idf.CallerContainer(ctx, int(p.pid), ids); err != nil {
				return Caller{}, err
			}
		}
	}
	if again, err := procStart(dir); err != nil || again != start {
		return Caller{}, errcode.New(errcode.Forbidden, "%s: the process that connected (pid %d) exited while the agent looked it up", cannotTell, p.pid)
	}
	switch {
	case ok && found.PodNamespace != "":
		return Caller{
			Admin: slices.Contains(s.cfg.AdminNamespaces, found.PodNamespace), Namespace: found.PodNamespace,
			Pod: found.PodName, Container: found.Name, PID: p.pid,
		}, nil
	case ok:
		return Caller{}, errcode.New(errcode.Forbidden, "%s: your container %s has no pod namespace label", cannotTell, found.ID)
	case !nested:
		return Caller{Admin: true, PID: p.pid}, nil
	}
	return Caller{}, errcode.New(errcode.Forbidden, "%s: your process (pid %d) is in a container the node's containerd does not run for a pod", cannotTell, p.pid)
}

// readSmall reads a /proc file of bounded size.
func readSmall(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, 64<<10))
}

// inNestedPidNS reports whether the process in dir is in a pid namespace
// below the one of the agent's /proc: NSpid lists its pid in each pid
// namespace from that one down.
func inNestedPidNS(dir string) (bool, error) {
	status, err := readSmall(dir + "/status")
	if err != nil {
		return false, err
	}
	for line := range strings.SplitSeq(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
			return len(strings.Fields(v)) > 1, nil
		}
	}
	return false, errcode.New(errcode.Internal, "%s/status has no NSpid line (Linux 4.1 or later has it)", dir)
}

// maxCandidates bounds the containers a caller's cgroups may make the
// agent look up.
const maxCandidates = 8

// cgroupContainerIDs returns the container IDs a /proc/PID/cgroup names,
// innermost first: path components that are 64 lowercase hex digits, or
// end in -ID.scope (systemd's cri-containerd-ID.scope).
func cgroupContainerIDs(cgroups []byte) []string {
	var ids []string
	for line := range bytes.SplitSeq(cgroups, []byte("\n")) {
		// hierarchy-ID:controllers:path; the path may hold ':'.
		parts := strings.SplitN(string(line), ":", 3)
		if len(parts) != 3 {
			continue
		}
		comps := strings.Split(parts[2], "/")
		for i := len(comps) - 1; i >= 0; i-- {
			id := containerIDIn(comps[i])
			if id != "" && !slices.Contains(ids, id) && len(ids) < maxCandidates {
				ids = append(ids, id)
			}
		}
	}
	return ids
}

func containerIDIn(comp string) string {
	comp = strings.TrimSuffix(comp, ".scope")
	if len(comp) < 64 {
		return ""
	}
	id := comp[len(comp)-64:]
	if len(comp) > 64 && comp[len(comp)-65] != '-' {
		return ""
	}
	for i := 0; i < len(id); i++ {
		if !('0' <= id[i] && id[i] <= '9' || 'a' <= id[i] && id[i] <= 'f') {
			return ""
		}
	}
	return id
}
