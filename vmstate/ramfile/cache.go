package ramfile

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Cache is a node-local directory of materialized RAM files, one per VM
// state image, named by the image's manifest digest
// (sha256-HEX.ram). A file appears under its name only once it is
// complete and verified, and vmsnap never writes it again: a restore that
// finds it fetches nothing. QEMU maps it private (share=off), so that the
// VMs restored from it share the pages they only read.
//
// A cache serves one trust domain: QEMU before 8.2 opens a share=off file
// read-write (its readonly=on makes the guest's RAM read-only), so a
// compromised QEMU could write into the file under every VM that maps it.
// QEMU 8.2 and later get readonly=on,rom=off (vmstate.QEMUArgs) and files
// of mode 0444 (ReadOnly).
type Cache struct {
	Dir string
	// PrivateParent says the directories above Dir are not shared with
	// other users (a pod's own volume, whose root Kubernetes makes
	// world-writable, seen only by that pod's containers): only Dir itself
	// is checked then.
	PrivateParent bool
	// ReadOnly makes the files it fills mode 0444 rather than 0644: for
	// QEMUs that open them read-only (8.2 and later, readonly=on), so that
	// a QEMU running as the cache's user cannot reopen one for writing
	// without first changing its mode. (Root, and a QEMU as that user
	// that does chmod, are not stopped by a mode: keep QEMU a user of its
	// own to rely on it.)
	ReadOnly bool
}

// suffix names a complete file; partial ones are ".sha256-HEX.ram.*".
const suffix = ".ram"

// Path is where the RAM file of the image whose manifest is key lives.
func (c Cache) Path(key digest.Digest) string {
	return filepath.Join(c.Dir, key.Algorithm().String()+"-"+key.Encoded()+suffix)
}

// KeyOf is the manifest digest a RAM file's name carries, or "" if the
// name is not one of vmsnap's: sha256-HEX.ram (a cache file) or
// NAME.sha256-HEX.ram (a VM's own copy, CopyFor).
func KeyOf(path string) digest.Digest {
	name, ok := strings.CutSuffix(filepath.Base(path), suffix)
	if !ok {
		return ""
	}
	if i := strings.LastIndexByte(name, '.'); i >= 0 {
		name = name[i+1:]
	}
	alg, hex, ok := strings.Cut(name, "-")
	if !ok {
		return ""
	}
	d := digest.NewDigestFromEncoded(digest.Algorithm(alg), hex)
	if d.Validate() != nil {
		return ""
	}
	return d
}

// IsOwnCopy says whether a RAM file's name is that of a VM's own copy
// (NAME.sha256-HEX.ram), which one VM maps shared, rather than of a cache
// file, which VMs map private.
func IsOwnCopy(path string) bool {
	name := strings.TrimSuffix(filepath.Base(path), suffix)
	return KeyOf(path) != "" && strings.Contains(name, ".")
}

// CopyFor makes a VM's own copy of key's complete cache file in dir
// (vm-RANDOM.sha256-HEX.ram, sparse: only data extents are copied), for a
// VM that maps its RAM shared so that it can be checkpointed in the
// memory-file format again. The copy is the caller's to remove.
func (c Cache) CopyFor(key digest.Digest, size int64, dir string) (string, error) {
	src, ok := c.Get(key, size)
	if !ok {
		return "", errcode.New(errcode.Internal, "the RAM cache has no file for %s to copy", key)
	}
	in, err := os.Open(src)
	if err != nil {
		return "", errcode.Wrap(errcode.Internal, err, "RAM cache")
	}
	defer in.Close()
	out, err := os.CreateTemp(dir, "vm-*."+filepath.Base(c.Path(key)))
	if err != nil {
		return "", errcode.Wrap(errcode.Internal, err, "creating the VM's own RAM file in %s (%s)", dir, errcode.Field("copyTo"))
	}
	ok = false
	defer func() {
		out.Close()
		if !ok {
			os.Remove(out.Name())
		}
	}()
	if err := out.Truncate(size); err != nil {
		return "", errcode.Wrap(errcode.Internal, err, "sizing the VM's own RAM file")
	}
	err = dataExtents(in, size, func(start, end int64) error {
		for off := start; off < end; {
			roff, woff := off, off
			n, err := unix.CopyFileRange(int(in.Fd()), &roff, int(out.Fd()), &woff, int(end-off), 0)
			if err != nil {
				return errcode.Wrap(errcode.Internal, err, "copying the RAM file")
			}
			if n == 0 {
				return errcode.New(errcode.Internal, "the cached RAM file ended early")
			}
			off += int64(n)
		}
		return nil
	})
	if err != nil {
		return "", err
	}
	ok = true
	return out.Name(), nil
}

// open makes the cache directory if needed (mode 0700) and checks it and
// every directory above it: each must be a real directory (no link),
// owned by this user or root, and writable by nobody else, unless it is
// root's and sticky (/dev/shm, /tmp), where others cannot rename what is
// ours. Otherwise someone else could swap the cache, or a directory above
// it, for one holding files of theirs, which would become a VM's memory.
func (c Cache) open() error { return c.walk(true) }

// walk checks the cache directory and those above it by open's rules,
// creating what is missing if create is set; otherwise a missing one is
// an error that wraps fs.ErrNotExist.
func (c Cache) walk(create bool) error {
	if c.Dir == "" {
		return errcode.New(errcode.Usage, "no cache directory: set %s", errcode.Field("cacheDir"))
	}
	return ownDir(c.Dir, c.PrivateParent, create, "RAM cache")
}

// OwnDir makes dir if needed (mode 0700) and checks it and the
// directories above it as a cache directory is checked (Cache): for a
// directory whose files only this user may put there. what names it in
// messages.
func OwnDir(dir, what string) error { return ownDir(dir, false, true, what) }

// ownDir is walk's rule for any directory; without create, a missing
// directory is an error that wraps fs.ErrNotExist.
func ownDir(dir string, privateParent, create bool, what string) error {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return errcode.Wrap(errcode.Usage, err, "%s %s", what, dir)
	}
	// Make what is missing, one level at a time, checking each level
	// before creating inside it.
	for _, d := range ancestors(dir) {
		fi, err := os.Lstat(d)
		if errors.Is(err, fs.ErrNotExist) && !create {
			return err
		}
		if errors.Is(err, fs.ErrNotExist) {
			if err := os.Mkdir(d, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
				return errcode.Wrap(errcode.Internal, err, "creating the %s %s", what, d)
			}
			fi, err = os.Lstat(d)
		}
		if err != nil {
			return errcode.Wrap(errcode.Internal, err, "%s %s", what, d)
		}
		if privateParent && d != dir {
			continue
		}
		if err := safeDir(d, fi, d == dir, what); err != nil {
			return err
		}
	}
	return nil
}

// ancestors lists dir's directories from the root down, dir last.
func ancestors(dir string) []string {
	var out []string
	for d := dir; ; d = filepath.Dir(d) {
		out = append(out, d)
		if d == filepath.Dir(d) {
			break
		}
	}
	slices.Reverse(out)
	return out
}

// safeDir is open's rule for one directory.
func safeDir(d string, fi fs.FileInfo, last bool, what string) error {
	st, ok := fi.Sys().(*syscall.Stat_t)
	me := uint32(os.Geteuid())
	owner := ok && (st.Uid == me || st.Uid == 0)
	writable := fi.Mode().Perm()&0o022 != 0
	sticky := fi.Mode()&fs.ModeSticky != 0 && ok && st.Uid == 0
	switch {
	case fi.Mode()&fs.ModeSymlink != 0 || !fi.IsDir():
		return errcode.New(errcode.Forbidden, "%s: %s is not a directory (a link?): give a directory whose path has no links", what, d)
	case !owner:
		return errcode.New(errcode.Forbidden, "%s: %s belongs to uid %d, not to this user (uid %d) or root: someone else could swap its files for theirs, which would decide a VM's memory; pick another directory", what, d, st.Uid, me)
	case last && (st.Uid != me || fi.Mode().Perm()&0o077 != 0):
		return errcode.New(errcode.Forbidden, "%s %s must be this user's (uid %d) with mode 0700: its files decide guests' memory (chmod 700 it)", what, d, me)
	case writable && !sticky:
		return errcode.New(errcode.Forbidden, "%s: %s may be written by others (chmod go-w it, or pick another directory): they could swap its files for theirs", what, d)
	}
	return nil
}

// Get returns the path of the complete file of key, if the cache has one
// of size bytes, and marks it used (for eviction).
func (c Cache) Get(key digest.Digest, size int64) (string, bool) {
	p := c.Path(key)
	fi, err := os.Lstat(p)
	if err != nil || !fi.Mode().IsRegular() || fi.Size() != size {
		return "", false
	}
	now := time.Now()
	_ = os.Chtimes(p, now, now)
	return p, true
}

// Fill returns the path of key's file, materializing it with fill if the
// cache lacks it. Concurrent fills of one key wait for each other (a lock
// file beside it); a failed or interrupted fill leaves nothing under the
// file's name. fetched is what fill fetched, 0 when the file was there.
func (c Cache) Fill(ctx context.Context, key digest.Digest, size int64, fill func(*os.File) (int64, error)) (path string, fetched int64, err error) {
	if err := c.open(); err != nil {
		return "", 0, err
	}
	if p, ok := c.Get(key, size); ok {
		return p, 0, nil
	}
	lock, err := os.OpenFile(c.Path(key)+".lock", os.O_CREATE|os.O_RDWR|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return "", 0, errcode.Wrap(errcode.Internal, err, "locking the RAM cache")
	}
	defer lock.Close()
	if err := flockContext(ctx, lock); err != nil {
		return "", 0, err
	}
	// The lock file stays: removing it while another fill waits on it
	// would let a third take a lock of its own on a new file.
	if p, ok := c.Get(key, size); ok { // another fill made it meanwhile
		return p, 0, nil
	}
	// Partial files of this key are a killed fill's: nobody else fills it
	// while we hold its lock.
	if stale, err := filepath.Glob(filepath.Join(c.Dir, "."+filepath.Base(c.Path(key))+".*")); err == nil {
		for _, p := range stale {
			os.Remove(p)
		}
	}
	tmp, err := os.CreateTemp(c.Dir, "."+filepath.Base(c.Path(key))+".*")
	if err != nil {
		return "", 0, errcode.Wrap(errcode.Internal, err, "creating a file in the RAM cache %s", c.Dir)
	}
	defer func() {
		tmp.Close()
		if err != nil {
			os.Remove(tmp.Name())
		}
	}()
	if fetched, err = fill(tmp); err != nil {
		return "", fetched, err
	}
	mode := os.FileMode(0o644)
	if c.ReadOnly {
		mode = 0o444
	}
	if err := tmp.Chmod(mode); err != nil {
		return "", fetched, errcode.Wrap(errcode.Internal, err, "RAM cache")
	}
	if err := os.Rename(tmp.Name(), c.Path(key)); err != nil {
		return "", fetched, errcode.Wrap(errcode.Internal, err, "RAM cache")
	}
	return c.Path(key), fetched, nil
}

func flockContext(ctx context.Context, f *os.File) error {
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			return errcode.Wrap(errcode.Internal, err, "locking the RAM cache")
		}
		select {
		case <-ctx.Done():
			return errcode.Wrap(errcode.Internal, context.Cause(ctx), "waiting for another vmsnap filling the same RAM file")
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Entry is one complete file in the cache.
type Entry struct {
	Path     string
	Key      digest.Digest
	Bytes    int64 // allocated (a RAM file is sparse), its kept state's included
	LastUsed time.Time
	// Published says a publication links the file (a pod's volume shows
	// it): eviction leaves it alone.
	Published bool
}

// List returns the cache's complete files, least recently used first.
func (c Cache) List() ([]Entry, error) {
	des, err := os.ReadDir(c.Dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	} else if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "reading the RAM cache")
	}
	var out []Entry
	for _, de := range des {
		p := filepath.Join(c.Dir, de.Name())
		key := KeyOf(p)
		if key == "" || p != c.Path(key) { // a VM's own copy, a partial file
			continue
		}
		fi, err := os.Lstat(p)
		if err != nil || !fi.Mode().IsRegular() {
			continue
		}
		e := Entry{Path: p, Key: key, LastUsed: fi.ModTime(), Bytes: c.stateBytes(key), Published: links(fi) > 1}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			e.Bytes += st.Blocks * 512
		}
		out = append(out, e)
	}
	slices.SortFunc(out, func(a, b Entry) int { return a.LastUsed.Compare(b.LastUsed) })
	return out, nil
}

// Evict removes the least recently used files until the cache holds at
// most maxBytes (0: no bound), and every file unused for longer than maxAge
// (0: no bound), keeping keep (the file just prepared) and every published
// file. A QEMU that maps a removed file keeps its pages: only the name
// goes, so nothing is ever half-visible.
func (c Cache) Evict(maxBytes int64, maxAge time.Duration, keep digest.Digest) ([]Entry, error) {
	if maxBytes <= 0 && maxAge <= 0 {
		return nil, nil
	}
	entries, err := c.List()
	if err != nil {
		return nil, err
	}
	var total int64
	for _, e := range entries {
		total += e.Bytes
	}
	var removed []Entry
	for _, e := range entries {
		tooBig := maxBytes > 0 && total > maxBytes
		tooOld := maxAge > 0 && time.Since(e.LastUsed) > maxAge
		if !tooBig && !tooOld || e.Key == keep || e.Published {
			continue
		}
		if err := c.remove(e); err != nil {
			return removed, err
		}
		total -= e.Bytes
		removed = append(removed, e)
	}
	return removed, nil
}

// remove unlinks a complete file and what the cache keeps beside it.
func (c Cache) remove(e Entry) error {
	if err := os.Remove(e.Path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return errcode.Wrap(errcode.Internal, err, "evicting %s from the RAM cache", e.Path)
	}
	os.Remove(e.Path + ".lock")
	os.RemoveAll(filepath.Join(c.Dir, stateName(e.Key)))
	return nil
}

// String is for logs.
func (e Entry) String() string { return fmt.Sprintf("%s (%d MiB)", e.Key, e.Bytes>>20) }
