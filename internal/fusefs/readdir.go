package fusefs

import "golang.org/x/sys/unix"

// readdir answers one READDIR: the directory's entries from the offset on
// (an offset is the index of the next entry), as many as fit in the size the
// kernel asked for. Handles are stateless, so each call lists the directory
// again; the tree's directories are small.
func (s *server) readdir(r request) []byte {
	if rootDenied(r) {
		return errMessage(r.unique, unix.EACCES)
	}
	in, err := r.readIn()
	if err != nil {
		return errMessage(r.unique, unix.EIO)
	}
	entries, err := s.tree.Readdir(r.node)
	if err != nil {
		return errMessage(r.unique, errnoOf(err))
	}
	m := outMessage(r.unique, 0, 0)
	size := int(min(in.size, MaxRead))
	for i := in.off; i < uint64(len(entries)); i++ {
		e := entries[i]
		if !validName(e.Name) || !validAttr(e.Attr) {
			continue
		}
		d := dirent(e, i+1)
		if len(m)-outHeaderSize+len(d) > size {
			break
		}
		m = append(m, d...)
	}
	le.PutUint32(m[0:], uint32(len(m)))
	return m
}

// dirent encodes a fuse_dirent, padded to 8 bytes; next is the offset of
// the entry after it.
func dirent(e Entry, next uint64) []byte {
	d := make([]byte, (direntBase+len(e.Name)+7)&^7)
	typ := uint32(unix.DT_REG)
	if e.Attr.Kind == Dir {
		typ = unix.DT_DIR
	}
	le.PutUint64(d[0:], e.Attr.Node)
	le.PutUint64(d[8:], next)
	le.PutUint32(d[16:], uint32(len(e.Name)))
	le.PutUint32(d[20:], typ)
	copy(d[direntBase:], e.Name)
	return d
}
