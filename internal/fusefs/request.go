package fusefs

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
)

// request is one kernel request, its body still raw. body aliases the
// buffer the request was read into.
type request struct {
	op     uint32
	unique uint64
	node   uint64
	uid    uint32
	body   []byte
}

// errMalformed: a request this server cannot take apart; it is answered EIO
// when its header names a unique, and dropped otherwise.
var errMalformed = errors.New("malformed FUSE request")

// parseRequest checks the fuse_in_header of b and splits off the body. The
// kernel writes these, so a failure here is a bug (ours or its), never a
// reason to crash: it returns errMalformed, and the unique when one is known.
func parseRequest(b []byte) (request, error) {
	if len(b) < inHeaderSize {
		return request{}, fmt.Errorf("%w: %d bytes, a header is %d", errMalformed, len(b), inHeaderSize)
	}
	r := request{
		op:     le.Uint32(b[4:]),
		unique: le.Uint64(b[8:]),
		node:   le.Uint64(b[16:]),
		uid:    le.Uint32(b[24:]),
	}
	if n := le.Uint32(b[0:]); int64(n) != int64(len(b)) {
		return r, fmt.Errorf("%w: header says %d bytes, read %d", errMalformed, n, len(b))
	}
	r.body = b[inHeaderSize:]
	return r, nil
}

// need returns the first n bytes of the body, or errMalformed.
func (r request) need(n int) ([]byte, error) {
	if len(r.body) < n {
		return nil, fmt.Errorf("%w: opcode %d has a %d-byte body, need %d", errMalformed, r.op, len(r.body), n)
	}
	return r.body[:n], nil
}

// name is the NUL-terminated name of a LOOKUP. A name that is empty, too
// long or has a slash is no name in this tree.
func (r request) name() (string, bool) {
	end := bytes.IndexByte(r.body, 0)
	if end <= 0 || end > 255 {
		return "", false
	}
	n := string(r.body[:end])
	return n, validName(n)
}

func validName(n string) bool {
	return n != "" && len(n) <= 255 && n != "." && n != ".." && !strings.ContainsAny(n, "/\x00")
}

// readIn is the part of a fuse_read_in we use (READ and READDIR).
type readIn struct {
	off  uint64
	size uint32
}

func (r request) readIn() (readIn, error) {
	b, err := r.need(24) // fh, offset, size: the rest is flags we ignore
	if err != nil {
		return readIn{}, err
	}
	return readIn{off: le.Uint64(b[8:]), size: le.Uint32(b[16:])}, nil
}

// u32 and u64 read the first field of a body (fuse_open_in.flags,
// fuse_access_in.mask, fuse_interrupt_in.unique).
func (r request) u32() (uint32, error) {
	b, err := r.need(4)
	if err != nil {
		return 0, err
	}
	return le.Uint32(b), nil
}

func (r request) u64() (uint64, error) {
	b, err := r.need(8)
	if err != nil {
		return 0, err
	}
	return le.Uint64(b), nil
}

// initIn is the kernel's INIT: its version and what it offers.
type initIn struct {
	major, minor, maxReadahead uint32
	flags                      uint64 // flags | flags2<<32
}

func (r request) initIn() (initIn, error) {
	b, err := r.need(16)
	if err != nil {
		return initIn{}, err
	}
	in := initIn{major: le.Uint32(b[0:]), minor: le.Uint32(b[4:]), maxReadahead: le.Uint32(b[8:]),
		flags: uint64(le.Uint32(b[12:]))}
	if in.flags&initExt != 0 && len(r.body) >= 20 {
		in.flags |= uint64(le.Uint32(r.body[16:])) << 32
	}
	return in, nil
}
