// Package beneath opens files that someone else controls without letting
// them redirect the open: a path below a directory handle is resolved by
// the kernel (openat2) so that it never leaves that directory, follows no
// symbolic link, magic link or mount, and what was opened is then checked
// and used through its descriptor, never looked up by name again.
//
// The node agent runs as root and opens files in a pod's volumes, whose
// contents the pod's processes may change at any moment: this is how it
// does so. Path opens a path the caller owns (the CLI's own) as given, so
// that both are used alike afterwards. It does not make a file's contents
// trustworthy: only which file is read.
package beneath

import (
	"errors"
	"io/fs"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// How every lookup below a handle is restricted.
const resolve = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// Dir opens an O_PATH handle on the directory at path, following links:
// path is trusted (a kubelet's volume directory, a snapshotter's upper
// directory); what is below it is not.
func Dir(path string) (*os.File, error) { return open(path, unix.O_DIRECTORY) }

// Path opens an O_PATH descriptor of the file at path, following links: a
// path the caller owns, opened once and then used through the descriptor
// like one from Open.
func Path(path string) (*os.File, error) { return open(path, 0) }

func open(path string, flags int) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_CLOEXEC|flags, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	return os.NewFile(uintptr(fd), path), nil
}

// Type is the type of the file f is open on (fs.ModeSocket, 0 for a
// regular file, ...), from fstat: the file itself, not what its name is now.
func Type(f *os.File) (fs.FileMode, error) {
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	return fi.Mode().Type(), nil
}

// Open returns an O_PATH descriptor of rel, a relative path below dir (a
// handle from Dir). A symbolic link anywhere on the way, the last
// component included, fails with ELOOP; a mount point or a way out of dir
// with EXDEV; a missing component with ENOENT or ENOTDIR. Opening with
// O_PATH has no effect on the file (a FIFO or a device is not opened for
// I/O): check its type with Stat, then Reopen it. name is the *os.File's
// name, for messages.
func Open(dir *os.File, rel, name string) (*os.File, error) {
	return openat2(dir, rel, name, 0, resolve)
}

// OpenMountPoint is Open for child, one name in dir, a directory that may
// be a mount point: the descriptor is then of the root of what is mounted
// there (the mount's own, in /proc/self/fdinfo), and getting it asks
// nothing of that file system, so a dead FUSE server cannot stall it. A
// link still fails with ELOOP, anything but a directory with ENOTDIR, and
// a child that is not one name (it holds a '/') with EINVAL.
func OpenMountPoint(dir *os.File, child, name string) (*os.File, error) {
	if child == "" || child == "." || child == ".." || strings.ContainsRune(child, '/') {
		return nil, &os.PathError{Op: "openat2", Path: name, Err: unix.EINVAL}
	}
	return openat2(dir, child, name, unix.O_DIRECTORY, resolve&^unix.RESOLVE_NO_XDEV)
}

func openat2(dir *os.File, rel, name string, flags uint64, resolve uint64) (*os.File, error) {
	how := unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC | flags, Resolve: resolve}
	for tries := 0; ; tries++ {
		fd, err := unix.Openat2(int(dir.Fd()), rel, &how)
		// EAGAIN: a rename elsewhere on the file system raced the lookup
		// (the kernel cannot tell it from an escape); it passes.
		if errors.Is(err, unix.EAGAIN) && tries < 16 {
			continue
		}
		if err != nil {
			return nil, &os.PathError{Op: "openat2", Path: name, Err: err}
		}
		return os.NewFile(uintptr(fd), name), nil
	}
}

// Reopen opens the file behind f (an O_PATH descriptor) for reading,
// through its /proc/self/fd link: the same inode, whatever its name now
// points to. Check that f is a regular file first: opening a FIFO for
// reading blocks, and opening a device may act on it.
func Reopen(f *os.File) (*os.File, error) {
	fd, err := unix.Open(ProcPath(f), unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, &os.PathError{Op: "reopen", Path: f.Name(), Err: err}
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}

// ProcPath is /proc/self/fd/N for f's descriptor N: connecting a unix
// socket to it reaches the socket f is open on, without looking up its
// path again, and however long that path is (a socket address holds 107
// bytes). f must stay open while the path is in use.
func ProcPath(f *os.File) string {
	return "/proc/self/fd/" + strconv.Itoa(int(f.Fd()))
}

// TypeName names a file type for messages: "a regular file", "a unix
// socket", "a directory", ...
func TypeName(t fs.FileMode) string {
	switch t.Type() {
	case 0:
		return "a regular file"
	case fs.ModeDir:
		return "a directory"
	case fs.ModeSymlink:
		return "a symbolic link"
	case fs.ModeSocket:
		return "a unix socket"
	case fs.ModeNamedPipe:
		return "a named pipe"
	case fs.ModeDevice, fs.ModeDevice | fs.ModeCharDevice:
		return "a device"
	}
	return "an irregular file"
}

// OpenFollowing is Open, except that it follows symbolic links that stay
// below dir: for a directory the caller trusts as a whole but whose files
// are links, as a Kubernetes Secret volume's are (KEY -> ..data/KEY). A
// link that leads out of dir, and a magic link (/proc/self/...), still
// fails with EXDEV or ELOOP.
func OpenFollowing(dir *os.File, rel, name string) (*os.File, error) {
	return openat2(dir, rel, name, 0, unix.RESOLVE_BENEATH|unix.RESOLVE_NO_MAGICLINKS)
}
