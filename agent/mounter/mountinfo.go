package mounter

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// What the mounter learns about a mount it reads from /proc, never from the
// mounted file system: fstat or statfs on a FUSE mount asks its server,
// which may be dead or stalled.

// fdMount is what /proc/self/fdinfo says of a descriptor: the id of the
// mount it is on and its inode number.
type fdMount struct {
	mountID int
	ino     uint64
}

func fdInfo(f *os.File) (fdMount, error) {
	name := fmt.Sprintf("/proc/self/fdinfo/%d", f.Fd())
	b, err := readBounded(name, 4<<10)
	if err != nil {
		return fdMount{}, err
	}
	var m fdMount
	var sawID, sawIno bool
	for line := range strings.SplitSeq(string(b), "\n") {
		key, val, _ := strings.Cut(line, ":")
		val = strings.TrimSpace(val)
		switch key {
		case "mnt_id":
			m.mountID, err = strconv.Atoi(val)
			sawID = err == nil
		case "ino":
			m.ino, err = strconv.ParseUint(val, 10, 64)
			sawIno = err == nil
		}
	}
	if !sawID || !sawIno {
		return fdMount{}, errcode.New(errcode.Internal, "%s lacks mnt_id or ino", name)
	}
	return m, nil
}

func readBounded(name string, max int64) ([]byte, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, max))
}

// mountEntry is one line of /proc/self/mountinfo.
type mountEntry struct {
	dev  string   // MAJOR:MINOR of the file system
	opts []string // per-mount options: ro or rw, nosuid, nodev, noexec, ...
}

// findMount returns the entry of the mount with this id.
func findMount(id int) (mountEntry, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return mountEntry{}, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 4<<10), 64<<10) // a line holds two escaped paths
	want := strconv.Itoa(id)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 6 && fields[0] == want {
			return mountEntry{dev: fields[2], opts: strings.Split(fields[5], ",")}, nil
		}
	}
	if err := sc.Err(); err != nil {
		return mountEntry{}, errcode.Wrap(errcode.Internal, err, "reading /proc/self/mountinfo")
	}
	return mountEntry{}, errcode.New(errcode.Internal, "mount %d is not in /proc/self/mountinfo", id)
}

// has says whether the mount has every option in want.
func (m mountEntry) has(want ...string) bool {
	for _, o := range want {
		if !slices.Contains(m.opts, o) {
			return false
		}
	}
	return true
}
