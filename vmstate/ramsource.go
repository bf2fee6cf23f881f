package vmstate

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// The RAM file of a memory-file checkpoint is named by QEMU (the backend's
// mem-path over QMP), and QEMU may be hostile: a vmsnap with more rights
// than QEMU (root, QEMU as the qemu user) must not read whatever file QEMU
// names into an image. So the file is opened without following a final
// link and without blocking (a FIFO), must be a regular file on a
// filesystem that holds RAM files, and must be the very file (device and
// inode) that the QEMU process at the other end of the monitor socket has
// mapped.

// peer is the part of the QMP client that names the process behind it.
type peer interface {
	PeerPID() (int, error)
}

// ramFilesystems are the filesystems a RAM file may live on, by statfs
// magic: memory (tmpfs, hugetlbfs) and the disk filesystems a host might
// put one on. Never procfs, sysfs and the like.
var ramFilesystems = map[int64]string{
	unix.TMPFS_MAGIC:           "tmpfs",
	unix.HUGETLBFS_MAGIC:       "hugetlbfs",
	unix.EXT4_SUPER_MAGIC:      "ext4",
	unix.XFS_SUPER_MAGIC:       "xfs",
	unix.BTRFS_SUPER_MAGIC:     "btrfs",
	unix.OVERLAYFS_SUPER_MAGIC: "overlay",
}

// openRAMFile opens the RAM file QEMU names, for the local checkpoint.
func openRAMFile(ctx context.Context, mon Executor, memPath string) (*os.File, error) {
	fd, err := unix.Open(memPath, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "opening the VM's RAM file %s (QEMU's mem-path)", memPath)
	}
	f := os.NewFile(uintptr(fd), memPath)
	if err := checkRAMFile(f, memPath); err != nil {
		f.Close()
		return nil, err
	}
	if p, ok := mon.(peer); ok {
		if err := checkMappedByPeer(p, f, memPath); err != nil {
			f.Close()
			return nil, err
		}
	}
	return f, nil
}

// checkRAMFile refuses anything but a regular file on a filesystem that
// holds RAM files.
func checkRAMFile(f *os.File, memPath string) error {
	fi, err := f.Stat()
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "reading the RAM file %s", memPath)
	}
	if !fi.Mode().IsRegular() {
		return errcode.New(errcode.InvalidInput, "QEMU's mem-path %s is %s, not a regular file", memPath, fi.Mode().Type())
	}
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &st); err != nil {
		return errcode.Wrap(errcode.Internal, err, "reading the RAM file's filesystem")
	}
	if _, ok := ramFilesystems[int64(st.Type)]; !ok {
		return errcode.New(errcode.InvalidInput, "QEMU's mem-path %s is on a filesystem (magic %#x) that holds no RAM files: put guest RAM on tmpfs or hugetlbfs", memPath, st.Type)
	}
	return nil
}

// checkMappedByPeer requires f to be a file the QEMU behind the monitor
// maps (its /proc/PID/maps lists f's device and inode).
func checkMappedByPeer(p peer, f *os.File, memPath string) error {
	m, pid, err := peerMapping(p, f)
	switch {
	case errors.Is(err, errNoPeer):
		return errcode.New(errcode.Forbidden, "cannot tell which process is behind the monitor socket, so cannot confirm that %s is the RAM file QEMU maps: use %s stream", memPath, errcode.Field("format"))
	case errors.Is(err, fs.ErrPermission):
		return errcode.New(errcode.Forbidden, "cannot read QEMU's (pid %d) memory map to confirm that %s is its RAM file: run vmsnap as QEMU's user or root, or use %s stream", pid, memPath, errcode.Field("format"))
	case err != nil:
		return errcode.Wrap(errcode.QMPError, err, "reading QEMU's (pid %d) memory map", pid)
	case !m.mapped:
		return errcode.New(errcode.InvalidInput, "QEMU (pid %d) names %s as its RAM file but does not map it: refused", pid, memPath)
	}
	return nil
}

// mapsShared says whether the QEMU behind mon maps f (a file of vmsnap's)
// shared, by f's device and inode, whatever name QEMU gave it; false when
// it does not, or that cannot be told.
func mapsShared(mon Executor, f *os.File) bool {
	p, ok := mon.(peer)
	if !ok || f == nil {
		return false
	}
	m, _, err := peerMapping(p, f)
	return err == nil && m.shared
}

var errNoPeer = errors.New("no process behind the monitor socket")

// mapping is how a process maps a file: at all, and shared anywhere.
type mapping struct{ mapped, shared bool }

// peerMapping reads how the QEMU behind the monitor maps f (any
// descriptor of it, O_PATH included) from its /proc/PID/maps: f's device
// and inode, never a name.
func peerMapping(p peer, f *os.File) (mapping, int, error) {
	pid, err := p.PeerPID()
	if err != nil || pid <= 0 {
		return mapping{}, pid, errNoPeer
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return mapping{}, pid, err
	}
	maps, err := os.Open("/proc/" + strconv.Itoa(pid) + "/maps")
	if err != nil {
		return mapping{}, pid, err
	}
	defer maps.Close()
	want := fmt.Sprintf("%02x:%02x %d", unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino)
	var m mapping
	sc := bufio.NewScanner(maps)
	sc.Buffer(make([]byte, 64<<10), 64<<10)
	for sc.Scan() {
		// address perms offset dev inode path
		fields := strings.Fields(sc.Text())
		if len(fields) >= 5 && fields[3]+" "+fields[4] == want {
			m.mapped = true
			m.shared = m.shared || strings.HasSuffix(fields[1], "s")
		}
	}
	return m, pid, sc.Err()
}
