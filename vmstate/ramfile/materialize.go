package ramfile

import (
	"context"
	"encoding/binary"
	"os"
	"strconv"
	"sync"
	"sync/atomic"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/vmstate/chunk"
)

// LoadPageMap fetches and verifies a RAM file's page map.
func LoadPageMap(ctx context.Context, layers Layers, src chunk.BlobSource, size int64) (*PageMap, error) {
	dec, err := chunk.NewDecoder()
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "zstd decoder")
	}
	defer dec.Close()
	pages := Pages(size)
	m := newPageMap(pages)
	next := 0
	for _, l := range layers.PageMap {
		first, count, err := pageMapRange(l)
		if err != nil {
			return nil, err
		}
		if first != next || first+count > pages {
			return nil, errcode.New(errcode.InvalidInput, "page map layer %s covers pages %d+%d, want the next from page %d of %d", l.Digest, first, count, next, pages)
		}
		raw, err := fetch(ctx, src, dec, l, entrySize*count, nil)
		if err != nil {
			return nil, err
		}
		for i := range count {
			e := raw[entrySize*i:]
			m.Fast[first+i] = binary.LittleEndian.Uint64(e)
			copy(m.Strong[first+i][:], e[8:entrySize])
		}
		next += count
	}
	if next != pages {
		return nil, errcode.New(errcode.InvalidInput, "the page map covers %d of the RAM file's %d pages", next, pages)
	}
	return &m, nil
}

// Verify checks every page of a materialized RAM file against the strong
// hashes of its image's page map: a data page must hash to its entry, and a
// page the map calls zero must be zeros (or a hole). It reads the file's
// data extents only, with workers goroutines.
func Verify(ctx context.Context, f *os.File, size int64, m *PageMap, workers int) error {
	if m.Len() != Pages(size) {
		return errcode.New(errcode.InvalidInput, "the page map has %d pages, the RAM file %d", m.Len(), Pages(size))
	}
	workers = max(workers, 1)
	const stripe = 64 << 20
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stripes := make(chan int64)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, RegionSize)
			for start := range stripes {
				if ctx.Err() != nil {
					continue
				}
				if err := verifyStripe(f, start, min(start+stripe, size), m, buf); err != nil {
					cancel(err)
				}
			}
		}()
	}
	for start := int64(0); start < size; start += stripe {
		select {
		case stripes <- start:
		case <-ctx.Done():
		}
	}
	close(stripes)
	wg.Wait()
	return context.Cause(ctx)
}

func verifyStripe(f *os.File, start, end int64, m *PageMap, buf []byte) error {
	mismatch := func(page int) error {
		return errcode.New(errcode.DigestMismatch, "page %d of the materialized RAM file does not match the image's page map: a layer of this image, or of a checkpoint it builds on, holds other pages than its checkpoint read (a forged or corrupt parent?); nothing was loaded", page)
	}
	next := start // the first page not checked yet
	holesTo := func(to int64) error {
		for off := next; off < to; off += PageSize {
			if !m.IsZero(int(off / PageSize)) {
				return mismatch(int(off / PageSize))
			}
		}
		return nil
	}
	err := dataExtentsIn(f, start, end, func(from, to int64) error {
		if err := holesTo(from); err != nil {
			return err
		}
		for off := from; off < to; {
			n := int(min(int64(len(buf)), to-off))
			if _, err := f.ReadAt(buf[:n], off); err != nil {
				return errcode.Wrap(errcode.Internal, err, "reading the RAM file")
			}
			for p := 0; p < n; p += PageSize {
				i := int((off + int64(p)) / PageSize)
				page := buf[p : p+PageSize]
				if m.IsZero(i) {
					if !isZero(page) {
						return mismatch(i)
					}
				} else if strongHashOf(page) != m.Strong[i] {
					return mismatch(i)
				}
			}
			off += int64(n)
		}
		next = to
		return nil
	})
	if err != nil {
		return err
	}
	return holesTo(end)
}

// fetch gets a blob from src (which verifies its digest) and decompresses
// it into exactly want bytes.
func fetch(ctx context.Context, src chunk.BlobSource, dec interface {
	DecodeAll([]byte, []byte) ([]byte, error)
}, l ocispec.Descriptor, want int, buf []byte) ([]byte, error) {
	data, err := src.Blob(ctx, l, l.Size)
	if err != nil {
		return nil, err
	}
	if cap(buf) < want {
		buf = make([]byte, 0, want)
	}
	out, err := dec.DecodeAll(data, buf[:0:want])
	if err != nil || len(out) != want {
		return nil, errcode.New(errcode.InvalidInput, "RAM layer %s does not decompress to its declared %d bytes", l.Digest, want)
	}
	return out, nil
}

// MaterializeOptions tunes Materialize.
type MaterializeOptions struct {
	Workers  int                   // regions fetched and written at once (default 2)
	Progress func(bytesDone int64) // compressed bytes fetched so far
	// MaxDataBytes, if above 0, is the most the file may allocate (the
	// image's declared data, with room for rounding): an image whose
	// layers write more than it declares is refused part-way, instead of
	// filling the disk.
	MaxDataBytes int64
}

// Materialize writes the RAM file the region layers make into f, which
// must be empty: it is sized to size, then every region is fetched,
// verified (digest, header, declared offset, pages inside the file) and
// written at its offset, in manifest order, so that a delta's pages
// replace its parent's. Zero pages are left as holes. It returns the
// compressed bytes fetched.
func Materialize(ctx context.Context, layers Layers, src chunk.BlobSource, f *os.File, size int64, opts MaterializeOptions) (int64, error) {
	if err := CheckSize(size); err != nil {
		return 0, err
	}
	if err := f.Truncate(size); err != nil {
		return 0, errcode.Wrap(errcode.Internal, err, "sizing the RAM file")
	}
	if opts.Workers <= 0 {
		opts.Workers = 2
	}
	var fetched atomic.Int64
	// A run of strictly increasing offsets holds each region at most once:
	// its layers may be written in any order. A run ends where a delta's
	// layers begin.
	regions := layers.Regions
	for len(regions) > 0 {
		n := 1
		last, _ := RegionOffset(regions[0])
		for n < len(regions) {
			off, err := RegionOffset(regions[n])
			if err != nil {
				return fetched.Load(), err
			}
			if off <= last {
				break
			}
			last = off
			n++
		}
		if err := materializeRun(ctx, regions[:n], src, f, size, opts, &fetched); err != nil {
			return fetched.Load(), err
		}
		if err := checkAllocated(f, opts.MaxDataBytes); err != nil {
			return fetched.Load(), err
		}
		regions = regions[n:]
	}
	return fetched.Load(), nil
}

func materializeRun(ctx context.Context, run []ocispec.Descriptor, src chunk.BlobSource, f *os.File, size int64, opts MaterializeOptions, fetched *atomic.Int64) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	jobs := make(chan ocispec.Descriptor)
	var wg sync.WaitGroup
	for range min(opts.Workers, len(run)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dec, err := chunk.NewDecoder()
			if err != nil {
				cancel(errcode.Wrap(errcode.Internal, err, "zstd decoder"))
				return
			}
			defer dec.Close()
			buf := make([]byte, 0, maxRegionRaw)
			for l := range jobs {
				if ctx.Err() != nil {
					continue
				}
				if err := writeRegion(ctx, l, src, dec, buf, f, size); err != nil {
					cancel(err)
					continue
				}
				if err := checkAllocated(f, opts.MaxDataBytes); err != nil {
					cancel(err)
					continue
				}
				if opts.Progress != nil {
					opts.Progress(fetched.Add(l.Size))
				} else {
					fetched.Add(l.Size)
				}
			}
		}()
	}
	for _, l := range run {
		select {
		case jobs <- l:
		case <-ctx.Done():
		}
	}
	close(jobs)
	wg.Wait()
	return context.Cause(ctx)
}

// writeRegion fetches one region layer, checks it and writes its pages:
// runs of data pages in one pwrite each, zero pages as punched holes.
func writeRegion(ctx context.Context, l ocispec.Descriptor, src chunk.BlobSource, dec interface {
	DecodeAll([]byte, []byte) ([]byte, error)
}, buf []byte, f *os.File, size int64) error {
	want, err := rawRegionSize(l)
	if err != nil {
		return err
	}
	raw, err := fetch(ctx, src, dec, l, want, buf)
	if err != nil {
		return err
	}
	r, err := parseRegion(raw, l, size)
	if err != nil {
		return err
	}
	pages := r.pages
	for i := 0; i < pagesPerRegion; {
		if !r.has(i) {
			i++
			continue
		}
		j := i
		for j < pagesPerRegion && r.has(j) {
			j++
		}
		data := pages[:(j-i)*PageSize]
		pages = pages[len(data):]
		off := r.offset + int64(i)*PageSize
		if err := writePages(f, data, off); err != nil {
			return err
		}
		i = j
	}
	return nil
}

// writePages writes a run of pages at off, leaving its zero pages out of
// the file (punched: a delta may zero a page its parent had data in).
func writePages(f *os.File, data []byte, off int64) error {
	for len(data) > 0 {
		n := PageSize
		zero := isZero(data[:PageSize])
		for n < len(data) && isZero(data[n:n+PageSize]) == zero {
			n += PageSize
		}
		var err error
		if zero {
			err = unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, int64(n))
		} else {
			_, err = f.WriteAt(data[:n], off)
		}
		if err != nil {
			return errcode.Wrap(errcode.Internal, err, "writing the RAM file")
		}
		data, off = data[n:], off+int64(n)
	}
	return nil
}

// rawRegionSize is the decompressed size a region layer declares: a
// header and up to a region's pages.
func rawRegionSize(l ocispec.Descriptor) (int, error) {
	n, err := strconv.Atoi(l.Annotations[ociimage.AnnotationRawSize])
	if err != nil || n < headerSize || n > maxRegionRaw || (n-headerSize)%PageSize != 0 {
		return 0, errcode.New(errcode.InvalidInput, "RAM region %s declares raw size %q: want a header and whole pages, at most %d bytes", l.Digest, l.Annotations[ociimage.AnnotationRawSize], maxRegionRaw)
	}
	return n, nil
}

// checkAllocated refuses a file that allocates more than max bytes (0: no
// bound).
func checkAllocated(f *os.File, max int64) error {
	if max <= 0 {
		return nil
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return errcode.Wrap(errcode.Internal, err, "checking the RAM file")
	}
	if got := st.Blocks * 512; got > max {
		return errcode.New(errcode.InvalidInput, "the image's RAM layers write more than the %d bytes of data its config declares (%d so far): refused", max, got)
	}
	return nil
}
