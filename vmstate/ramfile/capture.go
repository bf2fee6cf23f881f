package ramfile

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"errors"
	"math/bits"
	"os"
	"syscall"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Capture is what a checkpoint took from a RAM file while the VM was
// stopped: the file's page map, and a copy of every page that differs from
// the parent's (all non-zero pages for a base), set aside in an unlinked
// staging file so that the VM can run again before anything is compressed
// or stored.
type Capture struct {
	Size    int64
	Map     *PageMap
	parent  *Parent  // nil for a base
	changed []uint32 // pages whose entry differs from the parent's, ascending
	// refuted has a bit per page whose fast hash matched a parent's that
	// needed verifying but whose strong hash did not: stored, as changed.
	refuted []uint64
	// Refuted is how many such pages there are: a parent that says it
	// holds what this VM's memory does not (forged, or corrupt).
	Refuted int
	staging *os.File // the changed non-zero pages, in order (Scan)
	shadow  bool     // staging holds page i at i*PageSize instead (Shadow)
	// StagedBytes is what the staging file holds; ScannedBytes what was
	// read of the RAM file (its data extents; holes are not read).
	StagedBytes, ScannedBytes int64
}

// Changed is how many pages differ from the parent (or are non-zero, for a
// base): what the checkpoint stores.
func (c *Capture) Changed() int { return len(c.changed) }

// Regions is how many region layers Store will make.
func (c *Capture) Regions() int {
	n, last := 0, int64(-1)
	for _, p := range c.changed {
		if r := int64(p) * PageSize / RegionSize; r != last {
			n, last = n+1, r
		}
	}
	return n
}

// Close frees the staging file.
func (c *Capture) Close() {
	if c.staging != nil {
		_ = c.staging.Truncate(0)
		c.staging.Close()
		c.staging = nil
	}
}

// Scan reads the first size bytes of the RAM file f, which nothing may
// write meanwhile (the VM is stopped), hashes every page, and copies each
// page that differs from parent (nil: each non-zero page) into a staging
// file in stagingDir. Only f's data extents are read: a hole is zero pages.
func Scan(f *os.File, size int64, parent *Parent, stagingDir string) (c *Capture, err error) {
	if err := CheckSize(size); err != nil {
		return nil, err
	}
	pages := Pages(size)
	if err := parent.check(pages); err != nil {
		return nil, err
	}
	if fi, err := f.Stat(); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "reading the RAM file")
	} else if !fi.Mode().IsRegular() || fi.Size() < size {
		return nil, errcode.New(errcode.InvalidInput, "the RAM file is not a regular file of at least %d bytes (QEMU's memory backend size)", size)
	}
	staging, err := os.CreateTemp(stagingDir, ".vmsnap-ram-*.tmp")
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "creating the RAM staging file in %s (pick another with %s)", stagingDir, errcode.Field("stagingDir"))
	}
	os.Remove(staging.Name())
	c = &Capture{Size: size, Map: newPageMap(pages), parent: parent, staging: staging}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	w := bufio.NewWriterSize(staging, 1<<20)
	if err := c.scan(f, w, stagingDir); err != nil {
		return nil, err
	}
	if err := w.Flush(); err != nil {
		return nil, stagingErr(stagingDir, err)
	}
	c.Map.finish()
	c.diff()
	return c, nil
}

// diff lists the pages to store: a base's data pages, a delta's pages
// whose fast hash differs from the parent's (zeroed ones included), walked
// over the words where either map has data.
func (c *Capture) diff() {
	for w := range c.Map.bits {
		either := c.Map.bits[w]
		if c.parent != nil {
			either |= c.parent.Map.bits[w]
		}
		for either != 0 {
			i := w*64 + bits.TrailingZeros64(either)
			either &= either - 1
			if c.parent == nil || c.parent.Map.Fast(i) != c.Map.Fast(i) || c.isRefuted(i) {
				c.changed = append(c.changed, uint32(i))
			}
		}
	}
}

// refute marks page i as one whose parent's strong hash did not match.
func (c *Capture) refute(i int) {
	if c.refuted == nil {
		c.refuted = make([]uint64, (c.Map.Len()+63)/64)
	}
	c.refuted[i/64] |= 1 << (i % 64)
	c.Refuted++
}

func (c *Capture) isRefuted(i int) bool {
	return c.refuted != nil && c.refuted[i/64]&(1<<(i%64)) != 0
}

// scan hashes the file's data extents into c.Map and writes the pages that
// differ from the parent to w, in file order (hashFile).
func (c *Capture) scan(f *os.File, w *bufio.Writer, stagingDir string) error {
	return hashFile(f, c.Size, c.verifyParent, func(win *window) error {
		c.ScannedBytes += int64(win.n)
		if err := c.stage(win, w); err != nil {
			return stagingErr(stagingDir, err)
		}
		return nil
	})
}

// verifyParent checks, for a parent that needs it, the window's pages
// whose fast hash matches the parent's against its strong hash (the
// workers of hashFile run it, in parallel).
func (c *Capture) verifyParent(win *window) {
	if c.parent == nil || !c.parent.Verify {
		return
	}
	first := win.firstPage()
	for k, h := range win.hashes {
		if _, refuted := c.parent.unchanged(first+k, h, win.page(k)); refuted {
			if win.refuted == nil {
				win.refuted = make([]bool, len(win.hashes))
			}
			win.refuted[k] = true
		}
	}
}

// stage enters win's data pages in the page map, in file order, and
// writes those that differ from the parent to w.
func (c *Capture) stage(win *window, w *bufio.Writer) error {
	first := win.firstPage()
	for k, h := range win.hashes {
		if h == 0 {
			continue
		}
		i := first + k
		c.Map.add(i, h)
		refuted := win.refuted != nil && win.refuted[k]
		if refuted {
			c.refute(i)
		}
		if c.parent != nil && c.parent.Map.Fast(i) == h && !refuted {
			c.Map.strong[len(c.Map.strong)-1] = c.parent.Map.Strong(i) // unchanged
			continue
		}
		if _, err := w.Write(win.page(k)); err != nil {
			return err
		}
		c.StagedBytes += PageSize
	}
	return nil
}

func stagingErr(dir string, err error) error {
	return errcode.Wrap(errcode.Internal, err, "writing the RAM staging file in %s (pick another with %s)", dir, errcode.Field("stagingDir"))
}

// Linux's lseek whence values for sparse files.
const (
	seekData = 3
	seekHole = 4
)

// dataExtents calls fn with each page-aligned extent of f's first size
// bytes that may hold data (SEEK_DATA/SEEK_HOLE; a filesystem without them
// is all data).
func dataExtents(f *os.File, size int64, fn func(start, end int64) error) error {
	fd := int(f.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, seekData)
		switch {
		case errors.Is(err, syscall.ENXIO):
			return nil
		case errors.Is(err, syscall.EINVAL):
			return fn(off, size)
		case err != nil:
			return errcode.Wrap(errcode.Internal, err, "reading the RAM file's extents")
		}
		if data >= size {
			return nil
		}
		hole, err := unix.Seek(fd, data, seekHole)
		if err != nil {
			return errcode.Wrap(errcode.Internal, err, "reading the RAM file's extents")
		}
		start := data &^ (PageSize - 1)
		end := min((max(hole, data+1)+PageSize-1)&^(PageSize-1), size)
		if err := fn(max(start, off), end); err != nil {
			return err
		}
		off = end
	}
	return nil
}

// encodePageMap compresses the entries of pages first..first+n, 24 bytes
// each (zeros for a page of zeros), as a stream: what it holds is the
// compressed piece, about 24 bytes per data page.
func encodePageMap(enc *zstd.Encoder, m *PageMap, first, n int) ([]byte, error) {
	var out bytes.Buffer
	enc.Reset(&out)
	buf := make([]byte, 0, 64<<10)
	var e [entrySize]byte
	for i := first; i < first+n; i++ {
		clear(e[:])
		if !m.IsZero(i) {
			k := m.index(i)
			putUint64(e[:], m.fast[k])
			copy(e[8:], m.strong[k][:])
		}
		buf = append(buf, e[:]...)
		if len(buf) == cap(buf) {
			if _, err := enc.Write(buf); err != nil {
				return nil, errcode.Wrap(errcode.Internal, err, "compressing the page map")
			}
			buf = buf[:0]
		}
	}
	if _, err := enc.Write(buf); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "compressing the page map")
	}
	if err := enc.Close(); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "compressing the page map")
	}
	return out.Bytes(), nil
}

func putUint64(b []byte, v uint64) {
	_ = b[7]
	b[0], b[1], b[2], b[3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
	b[4], b[5], b[6], b[7] = byte(v>>32), byte(v>>40), byte(v>>48), byte(v>>56)
}

func blobDesc(mediaType string, data []byte) ocispec.Descriptor {
	sum := sha256.Sum256(data)
	return ocispec.Descriptor{MediaType: mediaType, Digest: digest.NewDigestFromBytes(digest.SHA256, sum[:]), Size: int64(len(data))}
}
