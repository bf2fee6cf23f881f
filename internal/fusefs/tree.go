// Package fusefs is vmsnap's own small FUSE server: a read-only filesystem of
// directories and files whose tree, node IDs and bytes belong to the caller
// (the agent's publications of RAM files). It speaks the kernel protocol
// directly, because it must do what FUSE libraries cannot: adopt a
// connection another process initialized (the /dev/fuse descriptor kept by a
// holder across an agent restart) and ask the kernel to resend the requests a
// dead server had read (FUSE_NOTIFY_RESEND).
//
// Immutability is the point: a file may be opened for writing (QEMU 7.2 opens
// a share=off memory file O_RDWR) but every write is refused, and a write
// open is answered with FOPEN_DIRECT_IO so that the kernel refuses a shared
// writable mapping, the one way a writer could otherwise change the page
// cache that every private mapper of the file shares.
//
// It is not a general FUSE library: no writes, no links, no locks, one mount
// option set.
package fusefs

import (
	"context"
	"errors"
	"syscall"
)

// Kind is what a node is.
type Kind uint8

const (
	Dir Kind = iota + 1
	File
)

// Attr describes a node. The server derives mode and ownership from Kind:
// directories 0555, files 0444, the root 0700, all owned by root.
type Attr struct {
	Node uint64 // the caller's ID: stable, never reused, never 0 or 1 (the root)
	Kind Kind
	Size int64 // files only
}

// Entry is one name in a directory.
type Entry struct {
	Name string
	Attr Attr
}

// Tree is the filesystem the server shows. Node 1 is the root, which the
// server describes itself; everything below it is the Tree's. Node IDs must
// stay valid for as long as the kernel may use them, also across a server
// restart (a resumed server answers the kernel's IDs from before).
//
// Errors: a syscall.Errno is passed to the kernel as is (ENOENT for a name
// that does not exist); any other error is EIO.
type Tree interface {
	Lookup(parent uint64, name string) (Attr, error)
	Readdir(dir uint64) ([]Entry, error)
	Attr(node uint64) (Attr, error)
	// Read fills dst with the file's bytes at off (dst never reaches past
	// the end of the file) and returns len(dst); anything less is EIO,
	// never a short read, which the kernel would fill with zeros. It may
	// block until the bytes exist; ctx is cancelled when the reader is
	// interrupted or the server stops, and then Read returns promptly.
	Read(ctx context.Context, node uint64, dst []byte, off int64) (int, error)
}

// errnoOf is the errno the kernel gets for err.
func errnoOf(err error) syscall.Errno {
	var errno syscall.Errno
	if errors.As(err, &errno) && errno != 0 {
		return errno
	}
	return syscall.EIO
}
