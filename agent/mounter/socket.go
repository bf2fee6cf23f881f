package mounter

import (
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"syscall"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// listen makes the mounter's socket: in a directory that only root may
// enter (created 0700 if missing; refused if anyone else may reach into
// it), replacing a stale socket of an earlier mounter.
func listen(path string) (*net.UnixListener, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "creating the mounter's socket directory")
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "examining the mounter's socket directory")
	}
	if owner(fi) != 0 || fi.Mode().Perm()&0o077 != 0 || !fi.IsDir() {
		return nil, errcode.New(errcode.Usage, "the mounter's socket directory %s must be a directory of root's with mode 0700 (it is %v, uid %d): "+
			"give the socket a directory of its own", dir, fi.Mode(), owner(fi))
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, errcode.New(errcode.Usage, "%s exists and is not a socket: remove it or give the mounter another --socket", path)
		}
		os.Remove(path) // an earlier mounter's
	}
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "listening on the mounter's socket")
	}
	ln.SetUnlinkOnClose(true)
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, errcode.Wrap(errcode.Internal, err, "restricting the mounter's socket")
	}
	return ln, nil
}

// owner is the uid that owns the file fi describes.
func owner(fi fs.FileInfo) uint32 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Uid
	}
	return ^uint32(0)
}
