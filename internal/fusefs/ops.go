package fusefs

import (
	"context"
	"errors"

	"golang.org/x/sys/unix"
)

// refused are the operations that would change the filesystem: data writes
// are EROFS, everything else EPERM.
var refused = map[uint32]unix.Errno{
	opWrite: unix.EROFS, opCopyFileRange: unix.EROFS, opCopyFileRange64: unix.EROFS,
	opSetattr: unix.EPERM, opFallocate: unix.EPERM, opSetxattr: unix.EPERM, opRemovexattr: unix.EPERM,
	opCreate: unix.EPERM, opMknod: unix.EPERM, opMkdir: unix.EPERM, opUnlink: unix.EPERM,
	opRmdir: unix.EPERM, opRename: unix.EPERM, opRename2: unix.EPERM, opLink: unix.EPERM,
	opSymlink: unix.EPERM, opTmpfile: unix.EPERM,
}

// dispatch answers r; nil means no answer (a READ left for the next server).
func (s *server) dispatch(ctx context.Context, r request) []byte {
	if errno, ok := refused[r.op]; ok {
		return errMessage(r.unique, errno)
	}
	switch r.op {
	case opLookup:
		return s.lookup(r)
	case opGetattr:
		return s.getattr(r)
	case opOpen:
		return s.open(r)
	case opRead:
		return s.read(ctx, r)
	case opOpendir:
		return s.opendir(r)
	case opReaddir:
		return s.readdir(r)
	case opAccess:
		return s.access(r)
	case opStatfs:
		m := outMessage(r.unique, 0, statfsOutSize)
		le.PutUint32(m[outHeaderSize+40:], 4096) // bsize
		le.PutUint32(m[outHeaderSize+44:], 255)  // namelen
		le.PutUint32(m[outHeaderSize+48:], 4096) // frsize
		return m
	case opRelease, opReleasedir, opFlush, opFsync, opFsyncdir:
		return outMessage(r.unique, 0, 0) // handles are stateless, nothing is dirty
	}
	return errMessage(r.unique, unix.ENOSYS)
}

// rootDenied: the root is 0700 root's, and without default_permissions the
// kernel leaves that check to us.
func rootDenied(r request) bool { return r.node == rootNode && r.uid != 0 }

func (s *server) lookup(r request) []byte {
	if rootDenied(r) {
		return errMessage(r.unique, unix.EACCES)
	}
	name, ok := r.name()
	if !ok {
		return errMessage(r.unique, unix.ENOENT)
	}
	a, err := s.tree.Lookup(r.node, name)
	if err == nil && !validAttr(a) {
		err = unix.EIO
	}
	if err != nil {
		return errMessage(r.unique, errnoOf(err))
	}
	// The kernel checks no permission on a walk through cached names, so
	// names in the root are never cached: each walk asks us again, and
	// rootDenied holds.
	valid := uint64(entryValid)
	if r.node == rootNode {
		valid = 0
	}
	m := outMessage(r.unique, 0, entryOutSize)
	putEntry(m[outHeaderSize:], a, valid)
	return m
}

// validAttr: the tree must not claim the root's ID, nor hand out an
// unknown kind or a negative size.
func validAttr(a Attr) bool {
	return a.Node > rootNode && (a.Kind == Dir || a.Kind == File) && a.Size >= 0
}

// attrOf is node's Attr: the root's is ours, the rest the tree's.
func (s *server) attrOf(node uint64) (Attr, error) {
	if node == rootNode {
		return Attr{Node: rootNode, Kind: Dir}, nil
	}
	a, err := s.tree.Attr(node)
	if err == nil && (!validAttr(a) || a.Node != node) {
		err = unix.EIO
	}
	return a, err
}

// fileAttrOf is attrOf of a node that must be a file: EISDIR otherwise.
func (s *server) fileAttrOf(node uint64) (Attr, error) {
	a, err := s.attrOf(node)
	if err == nil && a.Kind != File {
		err = unix.EISDIR
	}
	return a, err
}

func (s *server) getattr(r request) []byte {
	a, err := s.attrOf(r.node)
	if err != nil {
		return errMessage(r.unique, errnoOf(err))
	}
	m := outMessage(r.unique, 0, attrOutSize)
	le.PutUint64(m[outHeaderSize:], attrValid)
	putAttr(m[outHeaderSize+16:], a)
	return m
}

// open accepts any access mode but never truncation. A write open gets
// DIRECT_IO, so the kernel refuses a MAP_SHARED mapping of it (ENODEV)
// while MAP_PRIVATE still maps the shared page cache; KEEP_CACHE everywhere,
// so an open does not drop what other mappers share.
func (s *server) open(r request) []byte {
	flags, err := r.u32()
	if err != nil {
		return errMessage(r.unique, unix.EIO)
	}
	if flags&unix.O_TRUNC != 0 {
		return errMessage(r.unique, unix.EPERM)
	}
	if _, err := s.fileAttrOf(r.node); err != nil {
		return errMessage(r.unique, errnoOf(err))
	}
	open := uint32(fopenKeepCache)
	if flags&unix.O_ACCMODE != unix.O_RDONLY && s.conn.directIOOnWrite {
		open |= fopenDirectIO
	}
	m := outMessage(r.unique, 0, openOutSize) // fh 0: handles are stateless
	le.PutUint32(m[outHeaderSize+8:], open)
	return m
}

// read asks the tree for the bytes, which may take until they arrive.
func (s *server) read(ctx context.Context, r request) []byte {
	in, err := r.readIn()
	if err != nil {
		return errMessage(r.unique, unix.EIO)
	}
	if int64(in.off) < 0 {
		return errMessage(r.unique, unix.EINVAL)
	}
	a, err := s.fileAttrOf(r.node)
	if err != nil {
		return errMessage(r.unique, errnoOf(err))
	}
	m := outMessage(r.unique, 0, int(min(int64(min(in.size, MaxRead)), max(a.Size-int64(in.off), 0))))
	n, err := s.tree.Read(ctx, r.node, m[outHeaderSize:], int64(in.off))
	switch cause := context.Cause(ctx); {
	case errors.Is(cause, errServerStopping):
		return nil
	case err != nil && errors.Is(cause, errInterrupted):
		return errMessage(r.unique, unix.EINTR)
	case err != nil:
		return errMessage(r.unique, errnoOf(err))
	case n != len(m)-outHeaderSize:
		// A short read is the end of the file to the kernel: it would show
		// zeros (and shrink the file) where the bytes are only missing.
		return errMessage(r.unique, unix.EIO)
	}
	return m
}

func (s *server) opendir(r request) []byte {
	if rootDenied(r) {
		return errMessage(r.unique, unix.EACCES)
	}
	return outMessage(r.unique, 0, openOutSize)
}

// access answers access(2): the root is root's alone, and nothing here can
// be written.
func (s *server) access(r request) []byte {
	mask, err := r.u32()
	switch {
	case err != nil:
		return errMessage(r.unique, unix.EIO)
	case rootDenied(r):
		return errMessage(r.unique, unix.EACCES)
	case mask&unix.W_OK != 0:
		return errMessage(r.unique, unix.EROFS)
	}
	return outMessage(r.unique, 0, 0)
}
