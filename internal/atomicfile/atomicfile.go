package atomicfile

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path/filepath"
	"syscall"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// sparseBlock is the granularity at which File leaves holes. It is a
// multiple of every common filesystem block size, so an all-zero block always
// becomes a real hole, and large enough that the zero check and the skipped
// write are cheap compared with the data.
const sparseBlock = 64 << 10

var zeroBlock [sparseBlock]byte

// TempInfix is in the name of every temporary file, .NAME.vmsnap-tmp-RANDOM,
// for callers that sweep what a crash left behind.
const TempInfix = ".vmsnap-tmp-"

// File writes a file that appears at its path complete or not at all:
// the data goes to a temporary file in the same directory (so the final
// rename cannot cross filesystems) that Commit renames over the path. A disk
// image restored this way can never be seen half-written by a QEMU that starts
// early, and an interrupted restore leaves the previous file intact.
//
// Writes keep the file sparse: every aligned 64 KiB block that is entirely
// zero is skipped instead of written, so restoring a mostly empty overlay
// costs no more disk than the original did. An File is not safe for
// concurrent use.
type File struct {
	path string
	tmp  *os.File

	flushed int64 // bytes before buf, always a multiple of sparseBlock
	buf     []byte
	err     error // first write failure; every later call returns it
	done    bool  // committed or aborted
}

// Create starts writing the file that Commit will put at path, with
// permissions perm (subject to the umask, as with os.Create). The temporary
// file is named .NAME.vmsnap-tmp-RANDOM beside path.
func Create(path string, perm os.FileMode) (*File, error) {
	dir, name := filepath.Split(path)
	if name == "" {
		return nil, errcode.New(errcode.Internal, "atomic file: %q names a directory, not a file", path)
	}
	var suffix [8]byte
	for range 10 {
		_, _ = rand.Read(suffix[:]) // never fails (crypto/rand panics instead)
		tmpPath := filepath.Join(dir, "."+name+TempInfix+hex.EncodeToString(suffix[:]))
		// O_EXCL: a leftover or concurrent temp file is never reused.
		f, err := os.OpenFile(tmpPath, os.O_RDWR|os.O_CREATE|os.O_EXCL, perm)
		if errors.Is(err, os.ErrExist) {
			continue
		}
		if err != nil {
			return nil, errcode.Wrap(errcode.Internal, err, "creating a temporary file for %s", path)
		}
		// The mode is the caller's decision, not the umask's: a restored
		// overlay must be writable by the group QEMU shares.
		if err := f.Chmod(perm); err != nil {
			f.Close()
			os.Remove(tmpPath)
			return nil, errcode.Wrap(errcode.Internal, err, "setting the mode of %s", tmpPath)
		}
		return &File{path: path, tmp: f, buf: make([]byte, 0, sparseBlock)}, nil
	}
	return nil, errcode.New(errcode.Internal, "creating a temporary file for %s: every random name was taken", path)
}

// Path is where Commit puts the file.
func (f *File) Path() string { return f.path }

// TempPath is the temporary file being written, for messages and tests.
func (f *File) TempPath() string { return f.tmp.Name() }

// Write appends p. Data is written in whole 64 KiB blocks; a partial block
// waits in memory until it is filled or Commit flushes it.
func (f *File) Write(p []byte) (int, error) {
	if f.done {
		return 0, errcode.New(errcode.Internal, "atomic file %s: write after Commit or Abort", f.path)
	}
	if f.err != nil {
		return 0, f.err
	}
	n := len(p)
	for len(p) > 0 {
		if len(f.buf) == 0 && len(p) >= sparseBlock {
			// Whole blocks go straight from p without a copy.
			k := len(p) / sparseBlock * sparseBlock
			if err := f.writeBlocks(p[:k]); err != nil {
				return n - len(p), err
			}
			p = p[k:]
			continue
		}
		c := min(len(p), sparseBlock-len(f.buf))
		f.buf = append(f.buf, p[:c]...)
		p = p[c:]
		if len(f.buf) == sparseBlock {
			if err := f.writeBlocks(f.buf); err != nil {
				return n - len(p) - c, err
			}
			f.buf = f.buf[:0]
		}
	}
	return n, nil
}

// writeBlocks writes data at f.flushed, leaving a hole for every all-zero
// block and writing each run of non-zero blocks with one call. The last block
// may be short only when Commit flushes the tail.
func (f *File) writeBlocks(data []byte) error {
	runStart := -1 // start in data of the pending non-zero run
	flush := func(end int) error {
		if runStart < 0 {
			return nil
		}
		_, err := f.tmp.WriteAt(data[runStart:end], f.flushed+int64(runStart))
		runStart = -1
		if err != nil {
			f.err = errcode.Wrap(errcode.Internal, err, "writing %s", f.path)
		}
		return f.err
	}
	for i := 0; i < len(data); i += sparseBlock {
		block := data[i:min(i+sparseBlock, len(data))]
		if bytes.Equal(block, zeroBlock[:len(block)]) {
			if err := flush(i); err != nil {
				return err
			}
		} else if runStart < 0 {
			runStart = i
		}
	}
	if err := flush(len(data)); err != nil {
		return err
	}
	f.flushed += int64(len(data))
	return nil
}

// Sync makes the temporary file hold exactly what was written so far, at its
// full length, and flushes it to disk, so that ReaderAt can check the data
// (a restored header, say) before Commit. Writing may continue afterwards.
func (f *File) Sync() error {
	if f.done {
		return errcode.New(errcode.Internal, "atomic file %s: Sync after Commit or Abort", f.path)
	}
	if f.err != nil {
		return f.err
	}
	// The partial block is written but stays buffered: flushed must remain
	// block-aligned, and once the block fills it is written again whole.
	if len(f.buf) > 0 && !bytes.Equal(f.buf, zeroBlock[:len(f.buf)]) {
		if _, err := f.tmp.WriteAt(f.buf, f.flushed); err != nil {
			f.err = errcode.Wrap(errcode.Internal, err, "writing %s", f.path)
			return f.err
		}
	}
	if err := f.tmp.Truncate(f.Size()); err != nil {
		f.err = errcode.Wrap(errcode.Internal, err, "setting the length of %s", f.path)
		return f.err
	}
	if err := f.tmp.Sync(); err != nil {
		f.err = errcode.Wrap(errcode.Internal, err, "syncing %s", f.path)
		return f.err
	}
	return nil
}

// Size is the number of bytes written so far.
func (f *File) Size() int64 { return f.flushed + int64(len(f.buf)) }

// ReaderAt reads the temporary file. What it returns is current only after
// Sync, and it fails once the file is committed or aborted.
func (f *File) ReaderAt() io.ReaderAt { return f.tmp }

// Commit flushes the data, sets the file's length (trailing zeros become a
// hole), makes it durable and renames it over the path, then syncs the
// directory so the rename itself survives a crash. On any failure before the
// rename the temporary file is removed and the path keeps what it had. If
// only the final directory sync fails, the new file is already in place but
// may not survive a power loss; the error says so.
func (f *File) Commit() error {
	if f.done {
		return errcode.New(errcode.Internal, "atomic file %s: Commit after Commit or Abort", f.path)
	}
	err := f.err
	if err == nil && len(f.buf) > 0 {
		err = f.writeBlocks(f.buf)
		f.buf = f.buf[:0]
	}
	if err == nil {
		// Skipped blocks at the end were never written: only Truncate gives
		// the file its full length.
		if e := f.tmp.Truncate(f.flushed); e != nil {
			err = errcode.Wrap(errcode.Internal, e, "setting the length of %s", f.path)
		}
	}
	if err == nil {
		if e := f.tmp.Sync(); e != nil {
			err = errcode.Wrap(errcode.Internal, e, "syncing %s", f.path)
		}
	}
	if err == nil {
		if e := f.tmp.Close(); e != nil {
			err = errcode.Wrap(errcode.Internal, e, "closing %s", f.path)
		}
	}
	if err == nil {
		if e := os.Rename(f.tmp.Name(), f.path); e != nil {
			err = errcode.Wrap(errcode.Internal, e, "moving the finished file into place at %s", f.path)
		}
	}
	if err != nil {
		f.discard()
		return err
	}
	f.done = true
	if e := SyncDir(filepath.Dir(f.path)); e != nil {
		return errcode.Wrap(errcode.Internal, e,
			"%s is in place but its directory could not be synced, so it may not survive a power loss", f.path)
	}
	return nil
}

// Abort discards the temporary file and leaves the path untouched. It is a
// no-op after Commit or a previous Abort, so `defer f.Abort()` is the way to
// clean up on every error path.
func (f *File) Abort() error {
	if f.done {
		return nil
	}
	return f.discard()
}

func (f *File) discard() error {
	f.done = true
	_ = f.tmp.Close() // may already be closed by Commit; the removal matters
	if err := os.Remove(f.tmp.Name()); err != nil && !errors.Is(err, os.ErrNotExist) {
		return errcode.Wrap(errcode.Internal, err, "removing the temporary file %s", f.tmp.Name())
	}
	return nil
}

// SyncDir fsyncs a directory, so that a rename, create or remove in it
// survives a crash. It tolerates EINVAL and only EINVAL: that is how Linux
// says a filesystem cannot fsync a directory (some FUSE and network
// filesystems), where the rename is atomic all the same and refusing every
// write would make vmsnap unusable there for nothing. Any other error, EIO
// or a full disk say, means the directory entry may not be durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if errors.Is(err, syscall.EINVAL) {
		err = nil
	}
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	return err
}

// WriteFile replaces path with data, with permissions perm, atomically: it is
// Create, Write and Commit in one call, for a small file.
func WriteFile(path string, data []byte, perm os.FileMode) error {
	f, err := Create(path, perm)
	if err != nil {
		return err
	}
	defer f.Abort()
	if _, err := f.Write(data); err != nil {
		return err
	}
	return f.Commit()
}
