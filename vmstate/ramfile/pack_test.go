package ramfile

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/klauspost/compress/zstd"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// legacyCheckpoint stores f as a base in the region-layer format of
// earlier versions (one layer per region), as they wrote it: what an old
// image holds, for the reader of both formats.
func legacyCheckpoint(t *testing.T, repo ociimage.Repository, f *os.File) Layers {
	t.Helper()
	c, err := Scan(f, testSize, nil, t.TempDir())
	must(t, err)
	defer c.Close()
	st, err := c.Store(context.Background(), repo, StoreOptions{}) // the page map
	must(t, err)
	enc, err := zstd.NewWriter(nil)
	must(t, err)
	l := Layers{PageMap: st.PageMap}
	buf := make([]byte, RegionSize)
	for off := int64(0); off < testSize; off += RegionSize {
		_, err := f.ReadAt(buf, off)
		must(t, err)
		var bitmap [pagesPerRegion / 8]byte
		raw := []byte{}
		for i := range pagesPerRegion {
			if p := buf[i*PageSize : (i+1)*PageSize]; !isZero(p) {
				bitmap[i/8] |= 1 << (i % 8)
				raw = append(raw, p...)
			}
		}
		if len(raw) == 0 {
			continue
		}
		raw = append(regionHeader(off, &bitmap), raw...)
		data := enc.EncodeAll(raw, nil)
		d := regionDesc(off, len(raw), data)
		must(t, repo.PutBlob(context.Background(), d, data))
		l.Regions = append(l.Regions, d)
	}
	return l
}

func TestRegionLayerImagesStillMaterialize(t *testing.T) {
	repo := layout(t)
	f := ramFile(t, rand.New(rand.NewPCG(11, 12)))
	l := legacyCheckpoint(t, repo, f)
	if len(l.Regions) < 5 || l.Index != nil {
		t.Fatalf("the legacy writer made %d region layers and index %v", len(l.Regions), l.Index)
	}
	if got := readAll(t, materialize(t, repo, l)); !bytes.Equal(got, readAll(t, f)) {
		t.Fatal("a region-layer image materialized other bytes than its RAM file")
	}
}

func TestPacksAreFewAndTheIndexCoversTheChain(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 14))
	repo := layout(t)
	f := ramFile(t, rng)
	base, _, st := checkpoint(t, repo, f, nil, Layers{})
	if len(st.Packs) != 1 || st.Frames != 8 {
		t.Fatalf("a base of 8 regions with data made %d packs of %d frames, want 1 of 8", len(st.Packs), st.Frames)
	}
	parentMap, err := LoadPageMap(context.Background(), base, repo, testSize)
	must(t, err)
	writeRandom(t, rng, f, 5<<20, PageSize)
	writeRandom(t, rng, f, 50<<20, PageSize) // a region the base did not have
	d1, _, st1 := checkpoint(t, repo, f, trusted(parentMap), base)
	x, err := LoadIndex(context.Background(), d1, repo, testSize)
	must(t, err)
	if st1.Frames != 2 || len(x.Packs) != 2 || len(x.Regions) != 9 {
		t.Fatalf("delta: %d frames, index of %d packs and %d regions; want 2, 2, 9", st1.Frames, len(x.Packs), len(x.Regions))
	}
	for _, r := range x.Regions {
		want := []uint16{0} // the base's pack
		switch r.Offset {
		case 4 << 20:
			want = []uint16{0, 1} // the base's frame, then the delta's
		case 50 << 20:
			want = []uint16{1}
		}
		var got []uint16
		for _, f := range r.Frames {
			got = append(got, f.Pack)
		}
		if !slices.Equal(got, want) {
			t.Errorf("region %d has frames in packs %v, want %v", r.Offset, got, want)
		}
	}
	if got := readAll(t, materialize(t, repo, d1)); !bytes.Equal(got, readAll(t, f)) {
		t.Fatal("base + delta differs from the RAM file")
	}
}

// Small packs: a base and a delta of several each, uploaded at once,
// give the file back, and every pack but each capture's last is full.
func TestManyPacksRoundTrip(t *testing.T) {
	defer func(n int) { packTarget = n }(packTarget)
	packTarget = 3 << 20
	rng := rand.New(rand.NewPCG(19, 20))
	repo := layout(t)
	f := ramFile(t, rng)
	base, _, st := checkpoint(t, repo, f, nil, Layers{})
	if len(st.Packs) < 3 {
		t.Fatalf("9 MiB of random data in 3 MiB packs made %d packs", len(st.Packs))
	}
	for _, d := range st.Packs[:len(st.Packs)-1] {
		if d.Size > int64(packTarget) || d.Size < int64(packTarget-maxFrameLen) {
			t.Errorf("pack %s of %d bytes: want a full pack of at most %d", d.Digest, d.Size, packTarget)
		}
	}
	m, err := LoadPageMap(context.Background(), base, repo, testSize)
	must(t, err)
	writeRandom(t, rng, f, 5<<20, 6<<20)
	d1, _, st1 := checkpoint(t, repo, f, trusted(m), base)
	if len(st1.Packs) < 2 || len(d1.Packs) != len(st.Packs)+len(st1.Packs) {
		t.Fatalf("the delta made %d packs, its manifest lists %d", len(st1.Packs), len(d1.Packs))
	}
	if got := readAll(t, materialize(t, repo, d1)); !bytes.Equal(got, readAll(t, f)) {
		t.Fatal("base + delta in many packs differs from the RAM file")
	}
}

// lyingSource flips a byte of every pack it serves, after its digest was
// checked: a store (or a range read) that gives other bytes than the
// pack's.
type lyingSource struct{ ociimage.Repository }

func (s lyingSource) Blob(ctx context.Context, d ocispec.Descriptor, limit int64) ([]byte, error) {
	b, err := s.Repository.Blob(ctx, d, limit)
	if err == nil && d.MediaType == ociimage.MediaTypeRAMPack {
		b[len(b)/3] ^= 0x40
	}
	return b, err
}

// A frame that is not its SHA-256 is refused by that check, before it is
// decompressed (the region hash would catch it later, after decoding).
func TestCorruptFrameIsRefusedByItsSHA256(t *testing.T) {
	repo := layout(t)
	l, _, _ := checkpoint(t, repo, ramFile(t, rand.New(rand.NewPCG(15, 16))), nil, Layers{})
	out, err := os.Create(filepath.Join(t.TempDir(), "out"))
	must(t, err)
	defer out.Close()
	_, err = Materialize(context.Background(), l, lyingSource{repo}, out, testSize, MaterializeOptions{Workers: 1})
	if errcode.Of(err) != errcode.DigestMismatch || !strings.Contains(err.Error(), "SHA-256 in the index") {
		t.Fatalf("a frame that is not its SHA-256 gave %v, want DIGEST_MISMATCH from the frame's SHA-256", err)
	}
}

// lie rewrites the image's index with change and stores it, returning
// the layers that name it.
func lie(t *testing.T, repo ociimage.Repository, l Layers, change func(x *Index)) Layers {
	t.Helper()
	x, err := LoadIndex(context.Background(), l, repo, testSize)
	must(t, err)
	change(x)
	enc, err := zstd.NewWriter(nil)
	must(t, err)
	data := enc.EncodeAll(x.Encode(), nil)
	d := blobDesc(ociimage.MediaTypeRAMIndex, data)
	must(t, repo.PutBlob(context.Background(), d, data))
	l.Index = &d
	return l
}

func TestLyingIndexIsRefused(t *testing.T) {
	rng := rand.New(rand.NewPCG(17, 18))
	repo := layout(t)
	f := ramFile(t, rng)
	base, _, _ := checkpoint(t, repo, f, nil, Layers{})
	m, err := LoadPageMap(context.Background(), base, repo, testSize)
	must(t, err)
	writeRandom(t, rng, f, 5<<20, PageSize)
	delta, _, _ := checkpoint(t, repo, f, trusted(m), base)
	cases := map[string]struct {
		l    Layers
		want errcode.Code
	}{
		"overlap": {lie(t, repo, base, func(x *Index) { x.Regions[1].Frames[0].Offset -= 16 }), errcode.InvalidInput},
		"gap":     {lie(t, repo, base, func(x *Index) { x.Regions = append(x.Regions[:1], x.Regions[2:]...) }), errcode.InvalidInput},
		"wrong header offset": {lie(t, repo, base, func(x *Index) {
			x.Regions[len(x.Regions)-1].Offset = testSize - RegionSize*2 // a region of zeros in the file
		}), errcode.InvalidInput},
		"unaligned offset":    {lie(t, repo, base, func(x *Index) { x.Regions[0].Offset = 4096 }), errcode.InvalidInput},
		"beyond the file":     {lie(t, repo, base, func(x *Index) { x.Regions[len(x.Regions)-1].Offset = testSize }), errcode.InvalidInput},
		"unsorted regions":    {lie(t, repo, base, func(x *Index) { x.Regions[0], x.Regions[1] = x.Regions[1], x.Regions[0] }), errcode.InvalidInput},
		"raw length":          {lie(t, repo, base, func(x *Index) { x.Regions[0].Frames[0].RawLength -= PageSize }), errcode.InvalidInput},
		"frame past a pack":   {lie(t, repo, base, func(x *Index) { x.Regions[0].Frames[0].Length += 1 << 30 }), errcode.InvalidInput},
		"pack not manifest's": {withPacks(base, delta.Packs[1:]), errcode.InvalidInput},
		"packs out of order":  {withPacks(delta, []ocispec.Descriptor{delta.Packs[1], delta.Packs[0]}), errcode.InvalidInput},
		"frames newest first": {lie(t, repo, delta, func(x *Index) {
			for i, r := range x.Regions {
				if len(r.Frames) == 2 {
					x.Regions[i].Frames[0], x.Regions[i].Frames[1] = r.Frames[1], r.Frames[0]
				}
			}
		}), errcode.InvalidInput},
		"region hash": {lie(t, repo, base, func(x *Index) { x.Regions[2].Hash[0] ^= 1 }), errcode.DigestMismatch},
		"delta's region hash": {lie(t, repo, delta, func(x *Index) {
			for i, r := range x.Regions {
				if len(r.Frames) == 2 {
					x.Regions[i].Hash[5] ^= 1
				}
			}
		}), errcode.DigestMismatch},
	}
	for name, c := range cases {
		out, err := os.Create(filepath.Join(t.TempDir(), "out"))
		must(t, err)
		_, err = Materialize(context.Background(), c.l, repo, out, testSize, MaterializeOptions{})
		out.Close()
		if errcode.Of(err) != c.want {
			t.Errorf("%s: got %v, want %s", name, err, c.want)
		}
	}
}

func withPacks(l Layers, packs []ocispec.Descriptor) Layers {
	l.Packs = packs
	return l
}

func TestIndexBoundedWhenDecompressed(t *testing.T) {
	enc, err := zstd.NewWriter(nil)
	must(t, err)
	bomb := enc.EncodeAll(make([]byte, MaxIndexBytes+1), nil)
	if _, err := DecodeIndex(bomb, testSize, nil); errcode.Of(err) != errcode.InvalidInput {
		t.Fatalf("an index of %d bytes decompressed: %v, want INVALID_INPUT", MaxIndexBytes+1, err)
	}
	if _, err := ParseIndex(make([]byte, MaxIndexBytes+1), testSize, nil); errcode.Of(err) != errcode.InvalidInput {
		t.Fatalf("ParseIndex of a too-large index: %v", err)
	}
}

func FuzzParseIndex(f *testing.F) {
	x := &Index{FileSize: testSize, Packs: []PackRef{{Digest: blobDesc("", []byte("p")).Digest, Size: 100}},
		Regions: []RegionEntry{{Offset: 0, Frames: []Frame{{Pack: 0, Offset: 0, Length: 60, RawLength: uint32(headerSize + PageSize)}}},
			{Offset: RegionSize, Frames: []Frame{{Pack: 0, Offset: 60, Length: 40, RawLength: uint32(headerSize)}}}}}
	packs := []ocispec.Descriptor{{Digest: x.Packs[0].Digest, Size: 100}}
	good := x.Encode()
	if _, err := ParseIndex(good, testSize, packs); err != nil {
		f.Fatalf("the seed index is refused: %v", err)
	}
	f.Add(good)
	f.Fuzz(func(t *testing.T, raw []byte) {
		got, err := ParseIndex(raw, testSize, packs)
		if err != nil {
			if errcode.Of(err) != errcode.InvalidInput {
				t.Fatalf("refused with %v, want INVALID_INPUT", err)
			}
			return
		}
		if !bytes.Equal(got.Encode(), raw) {
			t.Fatal("an index it took does not encode back to its bytes")
		}
	})
}
