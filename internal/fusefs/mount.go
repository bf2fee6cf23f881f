package fusefs

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Mount opens /dev/fuse and mounts a filesystem served on it at dir (needs
// CAP_SYS_ADMIN). Accept the returned descriptor to serve it. allow_other lets
// QEMU in any pod open the files; there is no default_permissions, so the
// kernel asks the server, which accepts a write open of a 0444 file (QEMU
// 7.2) and refuses the writes.
func Mount(dir string) (fd int, err error) {
	fd, err = unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, errcode.Wrap(errcode.Internal, err, "opening /dev/fuse (is the fuse module loaded, and are we root?)")
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=%d,group_id=%d,allow_other,max_read=%d",
		fd, os.Getuid(), os.Getgid(), MaxRead)
	flags := uintptr(unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC)
	if err := unix.Mount("vmsnap", dir, "fuse.vmsnap", flags, opts); err != nil {
		unix.Close(fd)
		return -1, errcode.Wrap(errcode.Internal, err, "mounting the vmsnap FUSE filesystem at %s (needs CAP_SYS_ADMIN)", dir)
	}
	return fd, nil
}

// Unmount detaches the mount at dir. It never waits for the server, so a
// dead or stuck one cannot hang it.
func Unmount(dir string) error {
	if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
		return errcode.Wrap(errcode.Internal, err, "unmounting %s", dir)
	}
	return nil
}

// Abort ends the FUSE connection mounted at dir through the fusectl
// filesystem: every request waiting on it fails, and so does every later
// one. It finds the connection in mountinfo, so it never touches the
// (possibly stuck) mount itself.
func Abort(dir string) error {
	id, err := connectionID(dir)
	if err == nil {
		err = writeAbort(id)
	}
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "aborting the FUSE connection at %s", dir)
	}
	return nil
}

// connectionID is the fusectl name of the connection mounted at dir: the
// minor of its device (FUSE mounts have major 0).
func connectionID(dir string) (string, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", err
	}
	defer f.Close()
	id := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && fields[4] == dir && strings.HasPrefix(fields[2], "0:") {
			id = strings.TrimPrefix(fields[2], "0:") // the last mount at dir is the visible one
		}
	}
	if id == "" {
		return "", fmt.Errorf("no FUSE mount at %s", dir)
	}
	return id, sc.Err()
}

// writeAbort writes to fusectl's abort file of connection id, mounting
// fusectl on a private directory first when the host has not.
func writeAbort(id string) error {
	ctl := "/sys/fs/fuse/connections"
	if _, err := os.Stat(filepath.Join(ctl, id)); err != nil {
		tmp, err := os.MkdirTemp("", "vmsnap-fusectl-")
		if err != nil {
			return err
		}
		defer os.Remove(tmp)
		if err := unix.Mount("fusectl", tmp, "fusectl", 0, ""); err != nil {
			return fmt.Errorf("mounting fusectl: %w", err)
		}
		defer unix.Unmount(tmp, unix.MNT_DETACH)
		ctl = tmp
	}
	return os.WriteFile(filepath.Join(ctl, id, "abort"), []byte("1"), 0)
}
