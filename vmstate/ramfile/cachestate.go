package ramfile

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"syscall"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/atomicfile"
	"github.com/vmsnap/vmsnap/internal/beneath"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// Beside each RAM file the cache keeps the image's manifest, config and
// device state (every layer but the RAM file's: a few hundred KiB) as an
// OCI layout, sha256-HEX.state, so that a restore on this node reads
// nothing from the store. With it, a file lists the repositories the state
// was fetched from (a restore uses it only for an image of one of those:
// the caller's policy, which allowed the restore's repository, allowed the
// state's source), one a line.
//
// A restore finds both by the image's digest, beneath a handle of the cache
// directory (Held), as regular files read within bounds: never by a path
// anyone else names, such as the mem-path a QEMU reports.

const (
	stateSuffix = ".state"
	sourcesFile = "vmsnap-sources"
	// maxSources bounds the repositories a state lists (the oldest go).
	maxSources = 32
	// maxSourcesFile bounds the file: a reference is at most a few
	// hundred bytes.
	maxSourcesFile = 64 << 10
	// maxKeptState bounds the state kept for one image (its config and
	// compressed device state chunks). A memory-file image's is a few
	// hundred KiB to a few MiB (QEMU's unshared RAM: ROMs, video memory);
	// a chunk's compressed size is what its writer says, which no raw
	// bound limits, so an image that holds more is read from the store.
	maxKeptState = 64 << 20
)

func stateName(key digest.Digest) string {
	return key.Algorithm().String() + "-" + key.Encoded() + stateSuffix
}

// repositoryOf names a reference's repository (no tag, no digest).
func repositoryOf(ref ociimage.Reference) string { return ref.WithTag("").String() }

// Held is a cache directory open for lookups by digest: a handle of the
// directory, beneath which every name is resolved. Close it once what it
// returned is no longer used.
type Held struct {
	dir     *os.File
	path    string
	handles []*os.File
}

// Hold opens the cache for lookups. A cache directory that is not there
// gives nil; one that open's rules refuse (another user's, writable by
// others, a link) gives their error.
func (c Cache) Hold() (*Held, error) {
	if c.Dir == "" {
		return nil, nil
	}
	if err := c.walk(false); errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	} else if err != nil {
		return nil, err
	}
	abs, _ := filepath.Abs(c.Dir)
	dir, err := beneath.Dir(abs)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "RAM cache %s", c.Dir)
	}
	return &Held{dir: dir, path: abs}, nil
}

// Close closes the cache's handle and every one it gave out.
func (h *Held) Close() {
	if h == nil {
		return
	}
	for _, f := range h.handles {
		f.Close()
	}
	h.dir.Close()
}

// open opens rel beneath the cache directory (or parent, a handle it gave
// out), as an O_PATH descriptor of a file of type want, kept until Close.
// Nil when there is none, or it is something else.
func (h *Held) open(parent *os.File, rel string, want fs.FileMode) *os.File {
	if parent == nil {
		parent = h.dir
	}
	f, err := beneath.Open(parent, rel, filepath.Join(parent.Name(), rel))
	if err != nil {
		return nil
	}
	if t, err := beneath.Type(f); err != nil || t != want {
		f.Close()
		return nil
	}
	h.handles = append(h.handles, f)
	return f
}

// File is an O_PATH descriptor of key's complete RAM file, a regular file
// of size bytes, or nil if the cache has none: what vmsnap prepared, to
// compare with what a QEMU maps.
func (h *Held) File(key digest.Digest, size int64) *os.File {
	if h == nil || key.Validate() != nil {
		return nil
	}
	f := h.open(nil, filepath.Base(Cache{}.Path(key)), 0)
	if f == nil {
		return nil
	}
	if fi, err := f.Stat(); err != nil || fi.Size() != size {
		return nil
	}
	return f
}

// State is the device state the cache keeps for key, as a read-only
// layout, if it was fetched from from's repository; nil otherwise.
func (h *Held) State(key digest.Digest, from ociimage.Reference) *ociimage.Layout {
	if h == nil || key.Validate() != nil {
		return nil
	}
	dir := h.open(nil, stateName(key), fs.ModeDir)
	if dir == nil {
		return nil
	}
	sources, err := readSources(h.open(dir, sourcesFile, 0))
	if err != nil || !slices.Contains(sources, repositoryOf(from)) {
		return nil
	}
	return ociimage.OpenLayoutIn(dir, ociimage.Reference{Layout: filepath.Join(h.path, stateName(key)), Digest: key})
}

// readSources reads the list of a state's sources from f (an O_PATH
// descriptor of a regular file), within its bound.
func readSources(f *os.File) ([]string, error) {
	if f == nil {
		return nil, fs.ErrNotExist
	}
	r, err := beneath.Reopen(f)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	b, err := io.ReadAll(io.LimitReader(r, maxSourcesFile+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxSourcesFile {
		return nil, errors.New("too large")
	}
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if line := sc.Text(); line != "" {
			out = append(out, line)
		}
	}
	return out, nil
}

// KeepState keeps the device state of the image desc (read from src,
// pinned to it) beside its RAM file, complete or absent, and records src's
// repository as a source of it. An image whose copy would not keep its
// digest (a decrypted copy of an encrypted image), or that holds more than
// maxKeptState, is not kept: a restore then reads the store. It is an
// optimization: a failure only means that.
func (c Cache) KeepState(ctx context.Context, src ociimage.Repository, desc ocispec.Descriptor) error {
	lock, err := os.OpenFile(c.Path(desc.Digest)+".lock", os.O_CREATE|os.O_RDWR|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "locking the RAM cache")
	}
	defer lock.Close()
	if err := flockContext(ctx, lock); err != nil {
		return err
	}
	dir := filepath.Join(c.Dir, stateName(desc.Digest))
	source := repositoryOf(src.Reference())
	if fi, err := os.Lstat(dir); err == nil && fi.IsDir() {
		return addSource(dir, source)
	}
	tmp, err := os.MkdirTemp(c.Dir, "."+stateName(desc.Digest)+".*")
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "RAM cache")
	}
	defer os.RemoveAll(tmp)
	dst, err := ociimage.Open(ctx, ociimage.Reference{Layout: tmp})
	if err != nil {
		return err
	}
	copied, err := ociimage.CopyLayers(ctx, src, dst, maxKeptState, 4, func(l ocispec.Descriptor) bool { return !IsRAMLayer(l) })
	if err != nil || copied.Digest != desc.Digest {
		return err
	}
	if err := addSource(tmp, source); err != nil {
		return err
	}
	if err := os.Rename(tmp, dir); err != nil {
		return errcode.Wrap(errcode.Internal, err, "RAM cache")
	}
	return nil
}

// addSource adds source to the sources of the state in dir (the caller
// holds the image's lock).
func addSource(dir, source string) error {
	p := filepath.Join(dir, sourcesFile)
	var sources []string
	if f, err := beneath.Path(p); err == nil {
		if t, _ := beneath.Type(f); t == 0 {
			sources, _ = readSources(f)
		}
		f.Close()
	}
	if slices.Contains(sources, source) {
		return nil
	}
	sources = append(sources, source)
	if len(sources) > maxSources {
		sources = sources[len(sources)-maxSources:]
	}
	var b bytes.Buffer
	for _, s := range sources {
		b.WriteString(s + "\n")
	}
	if err := atomicfile.WriteFile(p, b.Bytes(), 0o600); err != nil {
		return errcode.Wrap(errcode.Internal, err, "RAM cache")
	}
	return nil
}

// stateBytes is what the state kept for key allocates (0 if none): it
// counts with the RAM file against the cache's bound (Evict).
func (c Cache) stateBytes(key digest.Digest) int64 {
	var n int64
	_ = filepath.WalkDir(filepath.Join(c.Dir, stateName(key)), func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if fi, err := d.Info(); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				n += st.Blocks * 512
			}
		}
		return nil
	})
	return n
}
