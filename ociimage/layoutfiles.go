package ociimage

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/beneath"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// A layout's files are read through one door (openFile): whatever its name
// says, a file is read only if it is a regular file (opening a FIFO blocks,
// and a device such as /dev/zero reads without end), and within a bound
// where its size is not known from a descriptor. A layout opened by path
// (Open) is its caller's own, and its names are followed as given; one in
// a directory someone else may have written (a RAM cache's device state,
// OpenLayoutIn) is read beneath a handle of that directory: no symbolic
// link, magic link, mount or ".." on the way.

// maxLayoutFile bounds oci-layout, which holds {"imageLayoutVersion":"1.0.0"}.
const maxLayoutFile = 4 << 10

// OpenLayoutIn opens, for reading only, the OCI layout whose directory dir
// is a handle of (beneath.Dir, or beneath.Open of a directory). ref names
// the image (ref.Layout is the directory's name in messages). The caller
// keeps dir open while the layout is in use.
func OpenLayoutIn(dir *os.File, ref Reference) *Layout {
	return &Layout{ref: ref, dir: ref.Layout, root: dir}
}

// errNotRegular is a layout file that is not a regular file.
type errNotRegular struct{ t fs.FileMode }

func (e errNotRegular) Error() string {
	return beneath.TypeName(e.t) + ", not a regular file"
}

// readOnly refuses a write to a layout opened beneath a handle.
func (l *Layout) readOnly() error {
	if l.root == nil {
		return nil
	}
	return errcode.New(errcode.Internal, "the OCI layout %s is open for reading only", l.dir)
}

// name is rel's path, for messages and for a layout opened by path.
func (l *Layout) name(rel string) string { return filepath.Join(l.dir, rel) }

// handle opens an O_PATH descriptor of rel: beneath the layout's handle, or
// by its path.
func (l *Layout) handle(rel string) (*os.File, error) {
	if l.root != nil {
		return beneath.Open(l.root, rel, l.name(rel))
	}
	return beneath.Path(l.name(rel))
}

// stat is rel's file information (from its descriptor: a link is followed
// only in a layout opened by path).
func (l *Layout) stat(rel string) (fs.FileInfo, error) {
	h, err := l.handle(rel)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	return h.Stat()
}

// openFile opens rel for reading if it is a regular file; the error wraps
// fs.ErrNotExist for a file that is not there.
func (l *Layout) openFile(rel string) (*os.File, fs.FileInfo, error) {
	h, err := l.handle(rel)
	if err != nil {
		return nil, nil, err
	}
	defer h.Close()
	fi, err := h.Stat()
	if err != nil {
		return nil, nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, nil, &os.PathError{Op: "open", Path: l.name(rel), Err: errNotRegular{fi.Mode().Type()}}
	}
	f, err := beneath.Reopen(h)
	return f, fi, err
}

// readFile reads rel whole, refusing one of more than limit bytes without
// reading past the bound.
func (l *Layout) readFile(rel string, limit int64) ([]byte, error) {
	f, _, err := l.openFile(rel)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return readAtMost(f, limit, func() error {
		return &os.PathError{Op: "read", Path: l.name(rel), Err: fmt.Errorf("larger than %d bytes", limit)}
	})
}

// blobRel is a blob's path inside the layout.
func blobRel(d digest.Digest) string {
	return filepath.Join(ocispec.ImageBlobsDir, digest.SHA256.String(), d.Encoded())
}
