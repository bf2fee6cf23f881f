//go:build linux

package agent

// Peer credentials on the agent's socket.
//
// The socket's mode (0660, the agent's user and --socket-group) is the first
// gate; the kernel's record of who connected is the second, so that a
// socket whose mode or directory someone loosened (a hostPath volume
// mounted with the wrong permissions, a chmod by hand) still admits only
// the callers the agent means to serve:
//
//   - uid 0;
//   - the agent's own (effective) uid;
//   - a process whose primary gid, or one of whose supplementary groups, is
//     the socket's group (Config.SocketGroup, else the agent's own gid).
//
// Who connected is SO_PEERCRED: the pid, uid and gid the kernel recorded
// when the peer called connect(), immune to what the peer does afterwards.
// SO_PEERCRED has no supplementary groups. They come from SO_PEERGROUPS
// (Linux 4.13+), recorded at connect() time too, so there is no race.
// Only where the kernel lacks SO_PEERGROUPS does the agent read the Groups:
// line of /proc/PID/status, and then it guards against the PID having been
// reused by another process since connect():
//
//   - the process there must have the same real and effective uid and gid as
//     SO_PEERCRED recorded (a process of another user that took the pid is
//     refused);
//   - it must have started no later than the connection was accepted (a
//     process that took the pid afterwards is refused);
//
// What remains is a process of the same uid and gid that got the very pid
// between the peer's connect() and the accept(), and that is in the group
// while the peer was not: such a user could run a process in the group
// anyway (it has one), so it gains nothing it could not do directly.
// Anything unreadable or inconsistent refuses the caller: the check fails
// closed.
//
// A refused caller is not simply disconnected, which a client would report
// as "the agent does not answer": the agent reads its request (bounded in
// size and time), answers 403 with {"error":{"code":"AUTH_FAILED",...}}
// naming the uid it saw and who may connect, closes the connection, and
// logs the refusal (uid, gid, pid) at warning level. The refusal is handled
// off the accept loop, a bounded number at once; beyond that a refused
// connection is closed at once.

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// peer is who is at the other end of an accepted connection.
type peer struct {
	pid      int32
	uid, gid uint32
	groups   []uint32 // supplementary groups
	via      string   // where groups came from: SO_PEERGROUPS or /proc
}

// peerPolicy decides which peers may use the API.
type peerPolicy struct {
	selfUID uint32
	group   uint32 // the socket's group
}

// allows says whether p may use the API.
func (pol peerPolicy) allows(p peer) bool {
	if p.uid == 0 || p.uid == pol.selfUID || p.gid == pol.group {
		return true
	}
	for _, g := range p.groups {
		if g == pol.group {
			return true
		}
	}
	return false
}

// peerGroupsFunc reads a peer's supplementary groups; tests replace it to
// exercise the /proc fallback.
var peerGroupsFunc = peerGroups

// credListener admits only the peers its policy allows.
type credListener struct {
	net.Listener
	policy   peerPolicy
	log      *slog.Logger
	refusals *refusals
}

// withPeerCheck wraps ln so that Accept returns only connections from
// allowed peers. group is the socket group as configured ("" for the
// agent's own).
func withPeerCheck(ln net.Listener, group string, log *slog.Logger, r *refusals) (net.Listener, error) {
	gid := uint32(os.Getegid())
	if group != "" {
		g, err := lookupGroup(group)
		if err != nil {
			return nil, err
		}
		gid = uint32(g)
	}
	return &credListener{
		Listener: ln,
		policy:   peerPolicy{selfUID: uint32(os.Geteuid()), group: gid},
		log:      log,
		refusals: r,
	}, nil
}

func (l *credListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		accepted := time.Now()
		p, err := peerOf(c, accepted)
		if err == nil && l.policy.allows(p) {
			return newCallerConn(c, p, accepted), nil
		}
		l.refuse(c, p, err)
	}
}

// refuse logs a refused peer and answers it off the accept loop.
func (l *credListener) refuse(c net.Conn, p peer, cause error) {
	attrs := []any{"pid", p.pid, "uid", p.uid, "gid", p.gid, "groups", p.groups, "socketGroup", l.policy.group}
	if cause != nil {
		attrs = append(attrs, "err", cause)
	}
	l.log.Warn("refused a caller on the agent socket", attrs...)
	var msg string
	if cause != nil {
		msg = "the agent could not establish who is calling (peer credentials), so it refuses the call"
	} else {
		msg = fmt.Sprintf("the agent refuses callers with uid %d: only root, the agent's uid (%d) and members of the socket's group (gid %d) may use it",
			p.uid, l.policy.selfUID, l.policy.group)
	}
	l.refusals.refuse(c, http.StatusForbidden, errcode.New(errcode.AuthFailed, "%s", msg))
}

// peerOf reads the credentials of the process that connected c.
func peerOf(c net.Conn, accepted time.Time) (peer, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return peer{}, fmt.Errorf("not a unix socket connection (%T)", c)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return peer{}, err
	}
	var (
		p      peer
		sysErr error
	)
	if err := raw.Control(func(fd uintptr) {
		var cred *unix.Ucred
		cred, sysErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
		if sysErr != nil {
			sysErr = fmt.Errorf("SO_PEERCRED: %w", sysErr)
			return
		}
		p = peer{pid: cred.Pid, uid: cred.Uid, gid: cred.Gid}
		p.groups, p.via, sysErr = peerGroupsFunc(int(fd), p, accepted)
	}); err != nil {
		return p, err
	}
	return p, sysErr
}

// peerGroups reads a peer's supplementary groups: SO_PEERGROUPS, else
// /proc/PID/status.
func peerGroups(fd int, p peer, accepted time.Time) ([]uint32, string, error) {
	groups, err := soPeerGroups(fd)
	if err == nil {
		return groups, "SO_PEERGROUPS", nil
	}
	if !errors.Is(err, unix.ENOPROTOOPT) && !errors.Is(err, unix.EINVAL) {
		return nil, "", fmt.Errorf("SO_PEERGROUPS: %w", err)
	}
	groups, err = procGroups(p, accepted)
	return groups, "/proc", err
}

// soPeerGroups is getsockopt(SO_PEERGROUPS): the peer's supplementary groups
// when it connected.
func soPeerGroups(fd int) ([]uint32, error) {
	buf := make([]uint32, 64)
	for {
		n := uint32(len(buf) * 4)
		_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_PEERGROUPS,
			uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&n)), 0)
		switch {
		case errno == 0:
			return buf[:n/4], nil
		case errno == unix.ERANGE && int(n/4) > len(buf) && n/4 <= 1<<16:
			buf = make([]uint32, n/4)
		default:
			return nil, errno
		}
	}
}

// procGroups reads the Groups: line of /proc/PID/status, refusing a process
// that is not the one that connected (see the package comment above).
func procGroups(p peer, accepted time.Time) ([]uint32, error) {
	if p.pid <= 0 {
		return nil, fmt.Errorf("no peer pid")
	}
	dir := "/proc/" + strconv.Itoa(int(p.pid))
	status, err := os.ReadFile(dir + "/status")
	if err != nil {
		return nil, err
	}
	var groups []uint32
	var sawUID, sawGID, sawGroups bool
	for line := range strings.SplitSeq(string(status), "\n") {
		key, val, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		f := strings.Fields(val)
		switch key {
		case "Uid", "Gid":
			// real, effective, saved, filesystem: SO_PEERCRED holds the
			// effective ones; the real ones must match too.
			want := p.uid
			if key == "Gid" {
				want = p.gid
			}
			if len(f) < 2 || f[0] != strconv.FormatUint(uint64(want), 10) || f[1] != f[0] {
				return nil, fmt.Errorf("pid %d is not the process that connected (its %s is %q, the connection's %d): the pid was reused", p.pid, key, val, want)
			}
			if key == "Uid" {
				sawUID = true
			} else {
				sawGID = true
			}
		case "Groups":
			sawGroups = true
			for _, s := range f {
				g, err := strconv.ParseUint(s, 10, 32)
				if err != nil {
					return nil, fmt.Errorf("%s/status: bad group %q", dir, s)
				}
				groups = append(groups, uint32(g))
			}
		}
	}
	if !sawUID || !sawGID || !sawGroups {
		return nil, fmt.Errorf("%s/status lacks Uid, Gid or Groups", dir)
	}
	started, err := procStart(dir)
	if err != nil {
		return nil, err
	}
	if err := startedBefore(p.pid, started, accepted); err != nil {
		return nil, err
	}
	return groups, nil
}

// startedBefore fails unless a process that started at started (since
// boot) existed when the connection was accepted: one that took the pid
// afterwards is not the caller. One tick (10 ms at USER_HZ 100) of slack
// for the rounding of both clocks.
func startedBefore(pid int32, started time.Duration, accepted time.Time) error {
	var now unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &now); err != nil {
		return err
	}
	acceptedBoot := time.Duration(now.Nano()) - time.Since(accepted)
	if started > acceptedBoot+10*time.Millisecond {
		return fmt.Errorf("pid %d started after the connection was accepted: the pid was reused", pid)
	}
	return nil
}

// clockTicks is USER_HZ, the unit of /proc/PID/stat's start time: 100 on
// every Linux architecture Go supports.
const clockTicks = 100

// procStart is when the process in dir started, as time since boot.
func procStart(dir string) (time.Duration, error) {
	b, err := os.ReadFile(dir + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name, in parentheses, may hold spaces and ')': fields
	// resume after the last ')'. starttime is field 22, the 20th after it.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("%s/stat: unexpected format", dir)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return 0, fmt.Errorf("%s/stat: unexpected format", dir)
	}
	ticks, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%s/stat: bad start time %q", dir, f[19])
	}
	return time.Duration(ticks) * time.Second / clockTicks, nil
}
