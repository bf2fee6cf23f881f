package ramfile

import (
	"context"
	"os"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/klauspost/compress/zstd"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
)

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

// DefaultMaterializeWorkers is how many regions Materialize fetches and
// writes at once unless told: a fetch mostly waits on the store.
const DefaultMaterializeWorkers = 4

// MaterializeOptions tunes Materialize.
type MaterializeOptions struct {
	Workers  int                   // regions fetched and written at once (default DefaultMaterializeWorkers)
	Progress func(bytesDone int64) // compressed bytes fetched so far
	// MaxDataBytes, if above 0, is the most the file may allocate (the
	// image's declared data, with room for rounding): an image whose
	// layers write more than it declares is refused part-way, instead of
	// filling the disk.
	MaxDataBytes int64
}

// Materialize writes the RAM file the image's layers make into f, which
// must be empty: it is sized to size. An image in the pack format is
// materialized from its index and packs (materializePacks); in the
// region-layer format of earlier versions, every region is fetched,
// verified (digest, header, declared offset, pages inside the file) and
// written at its offset. Layers apply in manifest order, a delta's pages
// replacing its parent's: they are processed newest first and each page is
// written once, by the last layer that has it (a delta's zero page is left
// a hole). It returns the compressed bytes fetched. What the file holds is
// then checked against the image's page map by Verify.
func Materialize(ctx context.Context, layers Layers, src chunk.BlobSource, f *os.File, size int64, opts MaterializeOptions) (int64, error) {
	if err := CheckSize(size); err != nil {
		return 0, err
	}
	if err := f.Truncate(size); err != nil {
		return 0, errcode.Wrap(errcode.Internal, err, "sizing the RAM file")
	}
	if opts.Workers <= 0 {
		opts.Workers = DefaultMaterializeWorkers
	}
	m := &materializer{src: src, f: f, size: size, opts: opts, written: make([]byte, (Pages(size)+7)/8)}
	if layers.Index != nil {
		err := m.materializePacks(ctx, layers)
		return m.fetched.Load(), err
	}
	// Runs of strictly increasing offsets hold each region at most once:
	// a run's layers may be written in any order, by several workers. A
	// run ends where a delta's layers begin.
	regions := layers.Regions
	var runs [][2]int // [start, end) in regions
	for start := 0; start < len(regions); {
		end := start + 1
		last, err := RegionOffset(regions[start])
		if err != nil {
			return 0, err
		}
		for end < len(regions) {
			off, err := RegionOffset(regions[end])
			if err != nil {
				return 0, err
			}
			if off <= last {
				break
			}
			last, end = off, end+1
		}
		runs = append(runs, [2]int{start, end})
		start = end
	}
	for k := len(runs) - 1; k >= 0; k-- {
		r := runs[k]
		// (Each region checks the file's allocation once written.)
		if err := m.run(ctx, regions[r[0]:r[1]]); err != nil {
			return m.fetched.Load(), err
		}
	}
	return m.fetched.Load(), nil
}

// materializer is one Materialize.
type materializer struct {
	src     chunk.BlobSource
	f       *os.File
	size    int64
	opts    MaterializeOptions
	fetched atomic.Int64
	// written has a bit per page a layer wrote (newer layers first). A
	// region's 512 pages are 64 whole bytes of it, so the workers of a run,
	// each on regions of its own, never share a byte.
	written []byte
}

// run writes one run's regions.
func (m *materializer) run(ctx context.Context, run []ocispec.Descriptor) error {
	return decodeEach(ctx, m.opts.Workers, run, func(ctx context.Context, dec *zstd.Decoder, buf []byte, l ocispec.Descriptor) error {
		if err := m.region(ctx, l, dec, buf); err != nil {
			return err
		}
		n := m.fetched.Add(l.Size)
		if m.opts.Progress != nil {
			m.opts.Progress(n)
		}
		return checkAllocated(m.f, m.opts.MaxDataBytes)
	})
}

// decodeEach runs do on every item, on up to workers workers, each with
// its zstd decoder and a region's buffer, and stops at the first error.
// An item is what the store gave, untrusted: a panic is an error
// (errcode.Safely).
func decodeEach[T any](ctx context.Context, workers int, items []T, do func(context.Context, *zstd.Decoder, []byte, T) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	jobs := make(chan T)
	var wg sync.WaitGroup
	for range min(workers, len(items)) {
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
			for it := range jobs {
				if ctx.Err() == nil {
					if err := errcode.Safely(func() error { return do(ctx, dec, buf, it) }); err != nil {
						cancel(err)
					}
				}
			}
		}()
	}
	for _, it := range items {
		select {
		case jobs <- it:
		case <-ctx.Done():
		}
	}
	close(jobs)
	wg.Wait()
	return context.Cause(ctx)
}

// region fetches one region layer, checks it and writes it.
func (m *materializer) region(ctx context.Context, l ocispec.Descriptor, dec interface {
	DecodeAll([]byte, []byte) ([]byte, error)
}, buf []byte) error {
	want, err := rawRegionSize(l)
	if err != nil {
		return err
	}
	raw, err := fetch(ctx, m.src, dec, l, want, buf)
	if err != nil {
		return err
	}
	off, err := RegionOffset(l)
	if err != nil {
		return err
	}
	r, err := parseRegion(raw, string(l.Digest), off, m.size)
	if err != nil {
		return err
	}
	return m.write(r)
}

// write writes the region's pages that no newer layer wrote: runs of data
// pages in one pwrite each, zero pages left as holes.
func (m *materializer) write(r region) error {
	base := int(r.offset / PageSize)
	// Consecutive pages to write are one pwrite: they are consecutive in
	// the blob as in the file.
	var pending []byte
	var pendingAt int64
	flush := func() error {
		if len(pending) == 0 {
			return nil
		}
		_, err := m.f.WriteAt(pending, pendingAt)
		pending = nil
		if err != nil {
			return errcode.Wrap(errcode.Internal, err, "writing the RAM file")
		}
		return nil
	}
	data := r.pages
	for i := range pagesPerRegion {
		if !r.has(i) {
			if err := flush(); err != nil {
				return err
			}
			continue
		}
		page := data[:PageSize]
		data = data[PageSize:]
		p := base + i
		if m.written[p/8]&(1<<(p%8)) != 0 {
			if err := flush(); err != nil { // a newer layer has it
				return err
			}
			continue
		}
		m.written[p/8] |= 1 << (p % 8)
		if isZero(page) {
			if err := flush(); err != nil {
				return err
			}
			continue
		}
		at := int64(p) * PageSize
		if len(pending) > 0 && pendingAt+int64(len(pending)) == at {
			pending = pending[:len(pending)+PageSize] // page follows in the blob
		} else {
			if err := flush(); err != nil {
				return err
			}
			pending, pendingAt = page, at
		}
	}
	return flush()
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
