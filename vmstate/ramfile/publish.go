package ramfile

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"syscall"

	"github.com/opencontainers/go-digest"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// A publication is a directory of the cache, pub/NAME/, holding one hard
// link to a complete file: what a pod's volume shows (the mounter binds the
// directory, read-only, onto the pod's target). A link, not a copy: the
// pods of one image share one inode, so its page cache is what their QEMUs
// share. A file with a publication is never evicted (its link count says
// so, without a journal to trust), and eviction only unlinks a cache name,
// so a pod sees the whole file or none.
const pubDir = "pub"

// publicationName is the grammar of publication names: the kubelet's
// volume ids of inline volumes, csi-<sha256 hex>, or any short name of
// letters, digits and '-' for other callers.
var publicationName = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,127}$`)

// PublicationDir is the directory of the publication name.
func (c Cache) PublicationDir(name string) string {
	return filepath.Join(c.Dir, pubDir, name)
}

// Publish links key's complete file (of size bytes) into the publication
// name and returns the publication's directory. Publishing the same file
// under the same name again is a no-op; another file under a name in use is
// an error.
func (c Cache) Publish(name string, key digest.Digest, size int64) (string, error) {
	if !publicationName.MatchString(name) {
		return "", errcode.New(errcode.InvalidInput, "publication name %q: letters, digits and '-', at most 128", name)
	}
	src, ok := c.Get(key, size)
	if !ok {
		return "", errcode.New(errcode.Internal, "the RAM cache %s holds no complete file of %s to publish", c.Dir, key)
	}
	if err := ownDir(filepath.Join(c.Dir, pubDir), true, true, "the RAM cache's publications"); err != nil {
		return "", err
	}
	// The publication is what the pod's QEMU (another user) lists and
	// opens, so it is 0755; pub/ above it stays the agent's alone (0700):
	// the bind mount shows the publication, not the path to it.
	dir := c.PublicationDir(name)
	if err := os.Mkdir(dir, 0o755); err == nil {
		_ = os.Chmod(dir, 0o755) // whatever the umask
	} else if !errors.Is(err, fs.ErrExist) {
		return "", errcode.Wrap(errcode.Internal, err, "creating the publication %s", dir)
	}
	if fi, err := os.Lstat(dir); err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o755 || !ownedBySelf(fi) {
		return "", errcode.New(errcode.Internal, "the publication %s is not a directory of mode 0755 of this user's: remove it", dir)
	}
	dst := filepath.Join(dir, filepath.Base(src))
	if err := os.Link(src, dst); errors.Is(err, fs.ErrExist) {
		if !sameFile(src, dst) {
			return "", errcode.New(errcode.Internal, "the publication %s holds another file than %s's", dir, key)
		}
	} else if err != nil {
		return "", errcode.Wrap(errcode.Internal, err, "linking %s into the publication %s", src, dir)
	}
	if others, _ := os.ReadDir(dir); len(others) != 1 {
		return "", errcode.New(errcode.Internal, "the publication %s holds %d files: it is in use for another image", dir, len(others))
	}
	return dir, nil
}

// Unpublish removes the publication name; one that is not there is not an
// error. The file stays in the cache (a pod that maps it keeps its pages
// either way) and becomes evictable once no publication links it.
func (c Cache) Unpublish(name string) error {
	if !publicationName.MatchString(name) {
		return errcode.New(errcode.InvalidInput, "publication name %q: letters, digits and '-', at most 128", name)
	}
	dir := c.PublicationDir(name)
	des, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	} else if err != nil {
		return errcode.Wrap(errcode.Internal, err, "reading the publication %s", dir)
	}
	for _, de := range des {
		if err := os.Remove(filepath.Join(dir, de.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return errcode.Wrap(errcode.Internal, err, "unpublishing %s", dir)
		}
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return errcode.Wrap(errcode.Internal, err, "unpublishing %s", dir)
	}
	return nil
}

func sameFile(a, b string) bool {
	fa, errA := os.Lstat(a)
	fb, errB := os.Lstat(b)
	return errA == nil && errB == nil && os.SameFile(fa, fb)
}

func ownedBySelf(fi fs.FileInfo) bool {
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && int(st.Uid) == os.Geteuid()
}

// links is a file's hard-link count: above 1, a publication holds it.
func links(fi fs.FileInfo) uint64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return uint64(st.Nlink)
	}
	return 1
}
