package ramfile

import (
	"context"
	"math/rand/v2"
	"os"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// forgedMap is m with the strong hashes of its first n data pages replaced:
// a parent whose map agrees with the VM's memory on xxhash64 (which anyone
// who read the VM's earlier page map knows, and which is no proof of
// content) but says its layers hold other pages there.
func forgedMap(m *PageMap, n int) *PageMap {
	f := *m
	f.strong = slices.Clone(m.strong)
	for k := range min(n, len(f.strong)) {
		f.strong[k][0] ^= 0xff
	}
	return &f
}

// A parent that needs verifying is believed only where the VM's memory has
// its strong hash: a scan and a shadow store the pages its map misstates,
// and count them; the same map trusted stores nothing (what a node-recorded
// parent is allowed).
func TestCaptureVerifiesAParentItDidNotRecord(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	f := ramFile(t, rng)
	base, err := Scan(f, testSize, nil, t.TempDir())
	must(t, err)
	_, err = base.Store(context.Background(), layout(t), StoreOptions{}) // fills in the strong hashes
	must(t, err)
	base.Close()
	const lies = 10
	forged := forgedMap(base.Map, lies)
	content := readAll(t, f)

	for _, verify := range []bool{false, true} {
		parent := &Parent{Map: forged, Verify: verify}
		scanned, err := Scan(f, testSize, parent, t.TempDir())
		must(t, err)
		defer scanned.Close()
		s, err := NewShadow(testSize, parent, t.TempDir())
		must(t, err)
		defer s.Close()
		feed(t, s, content, rng, true)
		shadowed, err := s.Capture()
		must(t, err)
		defer shadowed.Close()
		for name, c := range map[string]*Capture{"scan": scanned, "shadow": shadowed} {
			want := 0
			if verify {
				want = lies
			}
			if c.Changed() != want || c.Refuted != want {
				t.Fatalf("%s, verify %v: %d pages changed, %d refuted; want %d", name, verify, c.Changed(), c.Refuted, want)
			}
			if verify && c.StagedBytes < lies*PageSize {
				t.Fatalf("%s: the refuted pages were not staged (%d bytes)", name, c.StagedBytes)
			}
		}
		if verify {
			// Stored, the map holds the pages' real strong hashes.
			_, err := scanned.Store(context.Background(), layout(t), StoreOptions{})
			must(t, err)
			if !slices.Equal(scanned.Map.strong, base.Map.strong) {
				t.Fatal("the verified capture's map does not hold the memory's own strong hashes")
			}
		}
	}
}

// Verify checks every page of a materialized file against the image's map,
// both hashes, holes included, and returns the map it verified.
func TestVerifyChecksEveryPage(t *testing.T) {
	rng := rand.New(rand.NewPCG(23, 24))
	repo := layout(t)
	f := ramFile(t, rng)
	l, c, _ := checkpoint(t, repo, f, nil, Layers{})
	out := materialize(t, repo, l)
	m, err := Verify(context.Background(), l, repo, out, testSize, true)
	must(t, err)
	if !slices.Equal(m.bits, c.Map.bits) || !slices.Equal(m.fast, c.Map.fast) || !slices.Equal(m.strong, c.Map.strong) {
		t.Fatal("the verified map is not the checkpoint's")
	}
	page := make([]byte, PageSize)
	for name, tamper := range map[string]func(*os.File){
		"a data page changed": func(f *os.File) {
			f.ReadAt(page, 5<<20)
			page[100] ^= 1
			f.WriteAt(page, 5<<20)
		},
		"data in a hole": func(f *os.File) { f.WriteAt([]byte{1}, 50<<20) },
		"a data page punched out": func(f *os.File) {
			must(t, unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, PageSize))
		},
	} {
		bad := materialize(t, repo, l)
		tamper(bad)
		if _, err := Verify(context.Background(), l, repo, bad, testSize, false); errcode.Of(err) != errcode.DigestMismatch {
			t.Errorf("%s: got %v, want DIGEST_MISMATCH", name, err)
		}
	}
	// Another image's map does not verify this file.
	other, _, _ := checkpoint(t, repo, ramFile(t, rand.New(rand.NewPCG(1, 1))), nil, Layers{})
	if _, err := Verify(context.Background(), Layers{PageMap: other.PageMap}, repo, out, testSize, false); errcode.Of(err) != errcode.DigestMismatch {
		t.Errorf("another image's map: got %v, want DIGEST_MISMATCH", err)
	}
}

// A node's record of a page map reads back exactly, and only for its size.
func TestPageMapEncodesAndDecodes(t *testing.T) {
	rng := rand.New(rand.NewPCG(25, 26))
	_, c, _ := checkpoint(t, layout(t), ramFile(t, rng), nil, Layers{})
	data, err := EncodePageMap(c.Map)
	must(t, err)
	m, err := DecodePageMap(data, testSize)
	must(t, err)
	if !slices.Equal(m.bits, c.Map.bits) || !slices.Equal(m.fast, c.Map.fast) || !slices.Equal(m.strong, c.Map.strong) {
		t.Fatal("the decoded map differs")
	}
	for name, tc := range map[string]struct {
		data []byte
		size int64
	}{
		"truncated":    {data[:len(data)/2], testSize},
		"another size": {data, testSize * 2},
		"garbage":      {[]byte("not zstd"), testSize},
	} {
		if _, err := DecodePageMap(tc.data, tc.size); errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("%s: got %v, want INVALID_INPUT", name, err)
		}
	}
}
