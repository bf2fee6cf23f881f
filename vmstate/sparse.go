package vmstate

import (
	"bytes"
	"errors"
	"io"
	"os"
	"syscall"
)

// Linux's lseek whence values for sparse files.
const (
	seekData = 3 // SEEK_DATA
	seekHole = 4 // SEEK_HOLE
)

// sparseReader reads a file's first size bytes, producing the zeros of its
// holes without reading them (SEEK_DATA/SEEK_HOLE): a mapped-ram file is
// mostly holes (every zero page of the guest).
type sparseReader struct {
	f         *os.File
	size, off int64
	end       int64 // end of the extent off is in
	hole      bool  // that extent is a hole
}

func (r *sparseReader) Read(p []byte) (int, error) {
	if r.off >= r.size {
		return 0, io.EOF
	}
	if r.off >= r.end {
		if err := r.nextExtent(); err != nil {
			return 0, err
		}
	}
	n := int(min(int64(len(p)), r.end-r.off))
	var err error
	if r.hole {
		clear(p[:n])
	} else {
		n, err = r.f.ReadAt(p[:n], r.off)
		if err == io.EOF && n > 0 {
			err = nil
		}
		if err == io.EOF { // the file shrank under us
			err = io.ErrUnexpectedEOF
		}
	}
	r.off += int64(n)
	return n, err
}

// nextExtent finds the data or hole extent that starts at r.off.
func (r *sparseReader) nextExtent() error {
	fd := int(r.f.Fd())
	data, err := syscall.Seek(fd, r.off, seekData)
	switch {
	case errors.Is(err, syscall.ENXIO): // nothing but a hole up to the end
		r.hole, r.end = true, r.size
		return nil
	case errors.Is(err, syscall.EINVAL): // no SEEK_DATA here: all data
		r.hole, r.end = false, r.size
		return nil
	case err != nil:
		return err
	case data > r.off:
		r.hole, r.end = true, min(data, r.size)
		return nil
	}
	hole, err := syscall.Seek(fd, r.off, seekHole)
	if err != nil {
		return err
	}
	r.hole, r.end = false, min(max(hole, r.off+1), r.size)
	return nil
}

// sparseWriter writes a stream into a file at increasing offsets, leaving
// every all-zero page out: the file was truncated to its full size, so
// those read back as the zeros they are, and take no space.
type sparseWriter struct {
	f   *os.File
	off int64
}

const sparsePage = 4096

var zeroPage [sparsePage]byte

func (w *sparseWriter) Write(p []byte) (int, error) {
	isZero := func(b []byte) bool { return bytes.Equal(b, zeroPage[:len(b)]) }
	for i := 0; i < len(p); {
		j := min(i+sparsePage, len(p))
		if isZero(p[i:j]) {
			i = j
			continue
		}
		k := j // extend the run of pages with data
		for k < len(p) {
			e := min(k+sparsePage, len(p))
			if isZero(p[k:e]) {
				break
			}
			k = e
		}
		if _, err := w.f.WriteAt(p[i:k], w.off+int64(i)); err != nil {
			return i, err
		}
		i = k
	}
	w.off += int64(len(p))
	return len(p), nil
}
