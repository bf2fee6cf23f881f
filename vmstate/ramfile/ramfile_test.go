package ramfile

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

const testSize = 64 << 20

func layout(t *testing.T) ociimage.Repository {
	t.Helper()
	ref, err := ociimage.ParseReference("oci:" + filepath.Join(t.TempDir(), "layout") + ":ram")
	if err != nil {
		t.Fatal(err)
	}
	repo, err := ociimage.Open(context.Background(), ref)
	if err != nil {
		t.Fatal(err)
	}
	return repo
}

// ramFile is a sparse file of testSize with random data in some ranges.
func ramFile(t *testing.T, rng *rand.Rand) *os.File {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), "ram"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := f.Truncate(testSize); err != nil {
		t.Fatal(err)
	}
	for _, r := range [][2]int64{{0, 1 << 20}, {5 << 20, 13 << 20}, {40<<20 + 4096, 40<<20 + 3*4096}, {testSize - 8192, testSize}} {
		writeRandom(t, rng, f, r[0], r[1]-r[0])
	}
	// A page of zeros written as data: stored nowhere all the same.
	if _, err := f.WriteAt(make([]byte, PageSize), 20<<20); err != nil {
		t.Fatal(err)
	}
	return f
}

func writeRandom(t *testing.T, rng *rand.Rand, f *os.File, off, n int64) {
	t.Helper()
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

func readAll(t *testing.T, f *os.File) []byte {
	t.Helper()
	b := make([]byte, testSize)
	if _, err := f.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

// checkpoint scans f against parent and stores it, returning the layers a
// manifest would list: the page map, the chain's index, the parent's
// packs then these.
func checkpoint(t *testing.T, repo ociimage.Repository, f *os.File, parent *Parent, parentLayers Layers) (Layers, *Capture, Stored) {
	t.Helper()
	c, err := Scan(f, testSize, parent, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var px *Index
	if parentLayers.Index != nil {
		if px, err = LoadIndex(context.Background(), parentLayers, repo, testSize); err != nil {
			t.Fatal(err)
		}
	}
	st, err := c.Store(context.Background(), repo, StoreOptions{Parent: px})
	if err != nil {
		t.Fatal(err)
	}
	l := Layers{PageMap: st.PageMap, Index: &st.Index, Packs: append(append([]ocispec.Descriptor(nil), parentLayers.Packs...), st.Packs...)}
	return l, c, st
}

// trusted is m as a parent this node computed (nil for a base).
func trusted(m *PageMap) *Parent {
	if m == nil {
		return nil
	}
	return &Parent{Map: m}
}

func materialize(t *testing.T, repo ociimage.Repository, l Layers) *os.File {
	t.Helper()
	out, err := os.Create(filepath.Join(t.TempDir(), "restored"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { out.Close() })
	if _, err := Materialize(context.Background(), l, repo, out, testSize, MaterializeOptions{}); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestBaseAndDeltasRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	repo := layout(t)
	f := ramFile(t, rng)

	base, c, st := checkpoint(t, repo, f, nil, Layers{})
	// 1 + 8 MiB + 2 pages + 2 pages of data, the zero page left out.
	wantPages := (1<<20+8<<20)/PageSize + 4
	if c.Changed() != wantPages || c.StagedBytes != int64(wantPages)*PageSize {
		t.Fatalf("base staged %d pages (%d bytes), want %d", c.Changed(), c.StagedBytes, wantPages)
	}
	if c.ScannedBytes >= testSize/2 {
		t.Errorf("scanned %d bytes of a mostly sparse %d-byte file: holes were read", c.ScannedBytes, testSize)
	}
	if st.UploadedBytes != st.StoredBytes {
		t.Errorf("a first checkpoint into an empty store uploaded %d of %d bytes", st.UploadedBytes, st.StoredBytes)
	}
	if got := readAll(t, materialize(t, repo, base)); !bytes.Equal(got, readAll(t, f)) {
		t.Fatal("the materialized base differs from the RAM file")
	}

	// Delta 1: 7 scattered 64 KiB rewrites, one page zeroed (punched), one
	// page written where there was a hole.
	parentMap, _ := LoadPageMap(context.Background(), base, repo, testSize)
	for i := range 7 {
		writeRandom(t, rng, f, int64(5<<20+i*1<<20+8192), 64<<10)
	}
	if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 4096, 4096); err != nil {
		t.Fatal(err)
	}
	writeRandom(t, rng, f, 30<<20, PageSize)
	d1, c1, st1 := checkpoint(t, repo, f, trusted(parentMap), base)
	if want := 7*16 + 2; c1.Changed() != want {
		t.Fatalf("delta changed %d pages, want %d", c1.Changed(), want)
	}
	if st1.UploadedBytes > 7*64<<10+1<<20 {
		t.Errorf("delta uploaded %d bytes for %d KiB of changes", st1.UploadedBytes, 7*64+8)
	}
	if got := readAll(t, materialize(t, repo, d1)); !bytes.Equal(got, readAll(t, f)) {
		t.Fatal("base + delta differs from the RAM file")
	}

	// Delta 2 on delta 1: an unchanged file stores nothing but its map.
	map1, _ := LoadPageMap(context.Background(), d1, repo, testSize)
	d2, c2, st2 := checkpoint(t, repo, f, trusted(map1), d1)
	if c2.Changed() != 0 || st2.Frames != 0 || len(st2.Packs) != 0 {
		t.Fatalf("an unchanged file gave a delta of %d pages in %d regions, %d packs", c2.Changed(), st2.Frames, len(st2.Packs))
	}
	if st2.UploadedBytes != 0 {
		t.Errorf("an unchanged file uploaded %d bytes (its page map and index are the parent's)", st2.UploadedBytes)
	}
	if got := readAll(t, materialize(t, repo, d2)); !bytes.Equal(got, readAll(t, f)) {
		t.Fatal("base + 2 deltas differs from the RAM file")
	}
}

func TestMaterializeRefusesTamperedRegion(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	dir := t.TempDir()
	ref, _ := ociimage.ParseReference("oci:" + dir + ":ram")
	repo, _ := ociimage.Open(context.Background(), ref)
	f := ramFile(t, rng)
	l, _, _ := checkpoint(t, repo, f, nil, Layers{})
	victim := l.Packs[len(l.Packs)/2]
	p := filepath.Join(dir, "blobs", "sha256", victim.Digest.Encoded())
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 1
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	out, _ := os.Create(filepath.Join(t.TempDir(), "out"))
	defer out.Close()
	_, err = Materialize(context.Background(), l, repo, out, testSize, MaterializeOptions{})
	if errcode.Of(err) != errcode.DigestMismatch {
		t.Fatalf("a tampered region gave %v, want DIGEST_MISMATCH", err)
	}
}

func TestSplitLayersRefusesBadLayers(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	repo := layout(t)
	l := legacyCheckpoint(t, repo, ramFile(t, rng))
	all := append(append([]ocispec.Descriptor(nil), l.PageMap...), l.Regions...)
	if _, err := SplitLayers(all, testSize); err != nil {
		t.Fatalf("good layers refused: %v", err)
	}
	mutate := map[string]func([]ocispec.Descriptor) []ocispec.Descriptor{
		"unaligned offset": func(ls []ocispec.Descriptor) []ocispec.Descriptor {
			ls[1].Annotations = map[string]string{ociimage.AnnotationRAMOffset: "4096", ociimage.AnnotationRawSize: ls[1].Annotations[ociimage.AnnotationRawSize]}
			return ls
		},
		"offset beyond the file": func(ls []ocispec.Descriptor) []ocispec.Descriptor {
			ls[1].Annotations = map[string]string{ociimage.AnnotationRAMOffset: "67108864", ociimage.AnnotationRawSize: ls[1].Annotations[ociimage.AnnotationRawSize]}
			return ls
		},
		"raw size past a region": func(ls []ocispec.Descriptor) []ocispec.Descriptor {
			ls[1].Annotations = map[string]string{ociimage.AnnotationRAMOffset: "0", ociimage.AnnotationRawSize: "99999999"}
			return ls
		},
		"no page map": func(ls []ocispec.Descriptor) []ocispec.Descriptor { return ls[1:] },
		"foreign layer": func(ls []ocispec.Descriptor) []ocispec.Descriptor {
			ls[1].MediaType = ociimage.MediaTypeChunk
			return ls
		},
	}
	for name, m := range mutate {
		ls := m(append([]ocispec.Descriptor(nil), all...))
		if _, err := SplitLayers(ls, testSize); errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("%s: got %v, want INVALID_INPUT", name, err)
		}
	}
	if _, err := SplitLayers(all, testSize*2); errcode.Of(err) != errcode.InvalidInput {
		t.Errorf("a page map shorter than the file: got %v", err)
	}
}

func TestCacheFillsOnceAndRefusesAForeignDirectory(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	repo := layout(t)
	l, _, _ := checkpoint(t, repo, ramFile(t, rng), nil, Layers{})
	c := Cache{Dir: filepath.Join(t.TempDir(), "cache")}
	key := l.Index.Digest // any digest names the image here
	fill := func(f *os.File) (int64, error) {
		return Materialize(context.Background(), l, repo, f, testSize, MaterializeOptions{})
	}
	// A killed fill's partial file goes with the next fill of its key.
	os.MkdirAll(c.Dir, 0o700)
	stale := filepath.Join(c.Dir, "."+filepath.Base(c.Path(key))+".12345")
	os.WriteFile(stale, []byte("partial"), 0o600)
	p1, n1, err := c.Fill(context.Background(), key, testSize, fill)
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Errorf("a killed fill's partial file is still there: %v", err)
	}
	if err != nil || n1 == 0 {
		t.Fatalf("first fill: %v, fetched %d", err, n1)
	}
	p2, n2, err := c.Fill(context.Background(), key, testSize, fill)
	if err != nil || n2 != 0 || p2 != p1 {
		t.Fatalf("second fill: %v, fetched %d, path %s (first %s)", err, n2, p2, p1)
	}
	if KeyOf(p1) != key || IsOwnCopy(p1) {
		t.Errorf("KeyOf(%s) = %s (own copy %v), want %s", p1, KeyOf(p1), IsOwnCopy(p1), key)
	}
	// A VM's own copy: the same bytes, as sparse, named for the same image.
	own, err := c.CopyFor(key, testSize, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(p1)
	b, _ := os.ReadFile(own)
	if !bytes.Equal(a, b) || KeyOf(own) != key || !IsOwnCopy(own) {
		t.Fatalf("own copy %s: equal %v, key %s, own %v", own, bytes.Equal(a, b), KeyOf(own), IsOwnCopy(own))
	}
	var sa, sb unix.Stat_t
	unix.Stat(p1, &sa)
	unix.Stat(own, &sb)
	if sb.Blocks > sa.Blocks+RegionSize/512 {
		t.Errorf("the copy allocates %d blocks, the cache file %d: holes were copied", sb.Blocks, sa.Blocks)
	}
	for _, bad := range []string{"x.ram", "sha256-zz.ram", "vm.sha256-" + key.Encoded() + ".raw", ".ram"} {
		if KeyOf(bad) != "" {
			t.Errorf("KeyOf(%q) = %s, want none", bad, KeyOf(bad))
		}
	}
	// A failed fill leaves nothing under the name.
	other := l.Packs[0].Digest
	if _, _, err := c.Fill(context.Background(), other, testSize, func(*os.File) (int64, error) {
		return 0, errcode.New(errcode.DigestMismatch, "bad")
	}); errcode.Of(err) != errcode.DigestMismatch {
		t.Fatalf("failing fill: %v", err)
	}
	if _, err := os.Stat(c.Path(other)); !os.IsNotExist(err) {
		t.Fatalf("a failed fill left %s: %v", c.Path(other), err)
	}
	entries, _ := c.List()
	if len(entries) != 1 {
		t.Fatalf("cache lists %d entries, want 1", len(entries))
	}
	// Eviction keeps the one asked for, drops the rest past the bound.
	if removed, _ := c.Evict(1, 0, key); len(removed) != 0 {
		t.Errorf("evicted %v, which was to be kept", removed)
	}
	if removed, _ := c.Evict(1, 0, ""); len(removed) != 1 {
		t.Errorf("evicted %v, want the one file", removed)
	}
	if err := os.Chmod(c.Dir, 0o777); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Fill(context.Background(), key, testSize, fill); errcode.Of(err) != errcode.Forbidden {
		t.Errorf("a world-writable cache directory: got %v, want FORBIDDEN", err)
	}
}

func TestMaterializeRefusesMoreDataThanDeclared(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	repo := layout(t)
	l, c, _ := checkpoint(t, repo, ramFile(t, rng), nil, Layers{})
	out, _ := os.Create(filepath.Join(t.TempDir(), "out"))
	defer out.Close()
	declared := c.StagedBytes / 4 // an image that claims a quarter of what it writes
	_, err := Materialize(context.Background(), l, repo, out, testSize, MaterializeOptions{MaxDataBytes: declared})
	if errcode.Of(err) != errcode.InvalidInput {
		t.Fatalf("an image writing %d bytes while declaring %d: got %v, want INVALID_INPUT", c.StagedBytes, declared, err)
	}
	var st unix.Stat_t
	unix.Fstat(int(out.Fd()), &st)
	// Each worker may finish the region it holds (4 by default).
	if st.Blocks*512 > declared+RegionSize*5 {
		t.Errorf("it was stopped only after %d bytes", st.Blocks*512)
	}
	if _, err := Materialize(context.Background(), l, repo, out, testSize, MaterializeOptions{MaxDataBytes: c.StagedBytes + RegionSize}); err != nil {
		t.Fatalf("the true size refused: %v", err)
	}
}

// Every directory above the cache counts: one that others may write (not
// root's and sticky) or a link lets them swap the cache for files of
// theirs.
func TestCacheRefusesUnsafeDirectoriesAbove(t *testing.T) {
	fill := func(f *os.File) (int64, error) { return 0, f.Truncate(PageSize) }
	key := digest.FromString("image")
	open := t.TempDir()
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	real := t.TempDir()
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(real, link); err != nil {
		t.Fatal(err)
	}
	for name, dir := range map[string]string{
		"a world-writable parent": filepath.Join(open, "vmsnap", "ram"),
		"a link in the path":      filepath.Join(link, "ram"),
	} {
		if _, _, err := (Cache{Dir: dir}).Fill(context.Background(), key, PageSize, fill); errcode.Of(err) != errcode.Forbidden {
			t.Errorf("%s (%s): got %v, want FORBIDDEN", name, dir, err)
		}
	}
	// Under a sticky world-writable directory of root's (/dev/shm, /tmp),
	// a directory of our own is fine.
	if fi, err := os.Stat("/tmp"); err == nil && fi.Mode()&os.ModeSticky != 0 {
		dir, err := os.MkdirTemp("/tmp", "vmsnap-cache-test-")
		if err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(dir)
		if _, _, err := (Cache{Dir: filepath.Join(dir, "ram")}).Fill(context.Background(), key, PageSize, fill); err != nil {
			t.Errorf("a cache of our own under sticky /tmp: %v", err)
		}
	}
}

// The page map keeps data pages only, found by rank: every lookup agrees
// with a plain per-page reference.
func TestPageMapRanks(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 14))
	const pages = 5000
	ref := make([]uint64, pages)
	m := newPageMap(pages)
	for i := range pages {
		if rng.IntN(3) == 0 {
			ref[i] = rng.Uint64() | 1
			m.add(i, ref[i])
			m.strong[len(m.strong)-1][0] = byte(i)
		}
	}
	m.finish()
	data := 0
	for i, h := range ref {
		if m.Fast(i) != h || m.IsZero(i) != (h == 0) {
			t.Fatalf("page %d: fast %x zero %v, want %x", i, m.Fast(i), m.IsZero(i), h)
		}
		if h != 0 {
			data++
			if m.Strong(i)[0] != byte(i) {
				t.Fatalf("page %d: strong hash of another page", i)
			}
		}
	}
	if m.DataPages() != data || m.Len() != pages {
		t.Fatalf("%d data pages of %d, want %d of %d", m.DataPages(), m.Len(), data, pages)
	}
}
