package ramfile

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// feed hands every page of content to s the way a pre-copy does: all
// pages once (zeros as Zero; with stale, every 7th page as something the
// guest then overwrote), then again some pages in a scattered order, the
// last copy being content's.
func feed(t *testing.T, s *Shadow, content []byte, rng *rand.Rand, stale bool) {
	t.Helper()
	pages := len(content) / PageSize
	page := func(i int) []byte { return content[i*PageSize : (i+1)*PageSize] }
	old := make([]byte, PageSize)
	// First pass: a stale copy of every 7th page, the rest as they are.
	for i := range pages {
		switch {
		case stale && i%7 == 0:
			for k := range old {
				old[k] = byte(rng.Uint32())
			}
			must(t, s.Page(i, old))
		case isZero(page(i)):
			must(t, s.Zero(i))
		default:
			must(t, s.Page(i, page(i)))
		}
	}
	// Later passes: pages that were data and are zero now, zero and data
	// now, and the stale ones, in a scattered order.
	order := rng.Perm(pages)
	for _, i := range order {
		if i%7 != 0 && i%11 != 0 {
			continue
		}
		if i%11 == 0 && !isZero(page(i)) {
			must(t, s.Zero(i)) // zeroed, then written again below
		}
		if isZero(page(i)) {
			must(t, s.Zero(i))
		} else {
			must(t, s.Page(i, page(i)))
		}
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestShadowCapturesWhatAScanOfTheFinalFileWould: a capture built from a
// pre-copy's pages, each page's last copy counting, is the capture a scan
// of the file holding those last copies gives, base and delta: the same
// page map, the same changed pages, and the same region blobs once stored.
func TestShadowCapturesWhatAScanOfTheFinalFileWould(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 5))
	f := ramFile(t, rng)
	repo := layout(t)

	var parent *PageMap
	for round := range 2 {
		if round == 1 {
			// A delta: rewrite a few ranges, zero one.
			writeRandom(t, rng, f, 6<<20, 3*PageSize)
			writeRandom(t, rng, f, 30<<20, PageSize)
			if _, err := f.WriteAt(make([]byte, 2*PageSize), 0); err != nil {
				t.Fatal(err)
			}
		}
		content := readAll(t, f)
		scanned, err := Scan(f, testSize, trusted(parent), t.TempDir())
		must(t, err)
		defer scanned.Close()

		s, err := NewShadow(testSize, trusted(parent), t.TempDir())
		must(t, err)
		defer s.Close()
		feed(t, s, content, rng, round == 0)
		shadowed, err := s.Capture()
		must(t, err)
		defer shadowed.Close()

		if !slices.Equal(scanned.changed, shadowed.changed) {
			t.Fatalf("round %d: the shadow changed %d pages, the scan %d", round, len(shadowed.changed), len(scanned.changed))
		}
		if !slices.Equal(scanned.Map.bits, shadowed.Map.bits) || !slices.Equal(scanned.Map.fast, shadowed.Map.fast) {
			t.Fatalf("round %d: the page maps differ", round)
		}
		if round == 1 && (shadowed.StagedBytes > int64(len(shadowed.changed))*PageSize || len(shadowed.changed) > 8) {
			t.Fatalf("a delta's shadow kept %d bytes for %d changed pages: it must keep only what differs from the parent", shadowed.StagedBytes, len(shadowed.changed))
		}
		a, err := scanned.Store(context.Background(), repo, StoreOptions{})
		must(t, err)
		b, err := shadowed.Store(context.Background(), repo, StoreOptions{})
		must(t, err)
		if !slices.EqualFunc(a.Packs, b.Packs, func(x, y ocispec.Descriptor) bool { return x.Digest == y.Digest }) || a.Index.Digest != b.Index.Digest ||
			!slices.EqualFunc(a.PageMap, b.PageMap, func(x, y ocispec.Descriptor) bool { return x.Digest == y.Digest }) {
			t.Fatalf("round %d: the shadow stored other blobs than the scan", round)
		}
		if round == 1 && b.UploadedBytes != 0 {
			t.Fatalf("the shadow's delta uploaded %d bytes the scan's had already stored", b.UploadedBytes)
		}
		parent = shadowed.Map
	}
}

func TestShadowRefusesPagesOutsideTheFileAndUnsentPages(t *testing.T) {
	s, err := NewShadow(16*PageSize, nil, t.TempDir())
	must(t, err)
	defer s.Close()
	page := make([]byte, PageSize)
	page[0] = 1
	for _, i := range []int{-1, 16, 1 << 30} {
		if err := s.Page(i, page); errcode.Of(err) != errcode.QMPError {
			t.Errorf("page %d of a 16-page file: %v, want QMP_ERROR", i, err)
		}
		if err := s.Zero(i); errcode.Of(err) != errcode.QMPError {
			t.Errorf("zero page %d of a 16-page file: %v, want QMP_ERROR", i, err)
		}
	}
	for i := range 16 {
		if i != 9 {
			must(t, s.Page(i, page))
		}
	}
	// A page QEMU never sent holds whatever the file held: refused, not
	// taken for zeros.
	if _, err := s.Capture(); errcode.Of(err) != errcode.QMPError {
		t.Fatalf("a capture with page 9 unsent: %v, want QMP_ERROR", err)
	}
}

// Pages QEMU never sent (a balloon's free-page hints) are read from the
// file once the VM is stopped: the capture is then the file's.
func TestShadowReadsUnsentPagesFromTheFile(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	f := ramFile(t, rng)
	content := readAll(t, f)
	scanned, err := Scan(f, testSize, nil, t.TempDir())
	must(t, err)
	defer scanned.Close()
	s, err := NewShadow(testSize, nil, t.TempDir())
	must(t, err)
	defer s.Close()
	skipped := 0
	for i := range testSize / PageSize {
		p := content[i*PageSize : (i+1)*PageSize]
		switch {
		case i%5 == 0: // a hinted page: never sent
			skipped++
		case isZero(p):
			must(t, s.Zero(i))
		default:
			must(t, s.Page(i, p))
		}
	}
	n, err := s.FillUnsent(f)
	must(t, err)
	if n != skipped {
		t.Fatalf("read %d unsent pages, %d were", n, skipped)
	}
	c, err := s.Capture()
	must(t, err)
	defer c.Close()
	if !slices.Equal(c.Map.fast, scanned.Map.fast) || !slices.Equal(c.changed, scanned.changed) {
		t.Fatal("a capture with unsent pages read from the file differs from the file's scan")
	}
}
