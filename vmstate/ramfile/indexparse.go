package ramfile

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"io"
	"slices"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// DecodeIndex decompresses an index blob (already verified by its digest)
// into at most MaxIndexBytes, and parses it (ParseIndex).
func DecodeIndex(data []byte, size int64, packs []ocispec.Descriptor) (*Index, error) {
	dec, err := newMapDecoder()
	if err != nil {
		return nil, err
	}
	defer dec.Close()
	if err := dec.Reset(bytes.NewReader(data)); err != nil {
		return nil, badIndex("not zstd: %v", err)
	}
	raw, err := io.ReadAll(io.LimitReader(dec, MaxIndexBytes+1))
	if err != nil {
		return nil, badIndex("does not decompress: %v", err)
	}
	if len(raw) > MaxIndexBytes {
		return nil, badIndex("decompresses to more than %d bytes", MaxIndexBytes)
	}
	return ParseIndex(raw, size, packs)
}

func badIndex(format string, args ...any) error {
	return errcode.New(errcode.InvalidInput, "the image's RAM index "+format+": refused, nothing was loaded", args...)
}

// indexReader reads the index's fields, remembering the first short read.
type indexReader struct {
	b   []byte
	bad bool
}

func (r *indexReader) next(n int) []byte {
	if r.bad || len(r.b) < n {
		r.bad = true
		return make([]byte, n)
	}
	out := r.b[:n]
	r.b = r.b[n:]
	return out
}

func (r *indexReader) u16() uint16 { return binary.LittleEndian.Uint16(r.next(2)) }
func (r *indexReader) u32() uint32 { return binary.LittleEndian.Uint32(r.next(4)) }
func (r *indexReader) u64() uint64 { return binary.LittleEndian.Uint64(r.next(8)) }

// ParseIndex parses a decompressed index of a RAM file of size bytes
// whose manifest lists packs, and checks everything it says before a
// byte of a pack is read: the header, the packs (the manifest's, in
// order), regions by increasing aligned offset inside the file, frames of
// bounded length inside their pack, in increasing packs, that tile every
// pack exactly (no gap, no overlap). A frame's header offset and raw length
// are checked when it is decoded (MaterializePacks).
func ParseIndex(raw []byte, size int64, packs []ocispec.Descriptor) (*Index, error) {
	if len(raw) > MaxIndexBytes {
		return nil, badIndex("is %d bytes, more than %d", len(raw), MaxIndexBytes)
	}
	if err := CheckSize(size); err != nil {
		return nil, err
	}
	r := &indexReader{b: raw}
	if string(r.next(len(indexMagic))) != indexMagic {
		return nil, badIndex("is not an index (magic)")
	}
	x := &Index{FileSize: int64(r.u64())}
	regionSize, npacks, nregions := r.u32(), r.u32(), r.u32()
	switch {
	case r.bad:
		return nil, badIndex("is cut short")
	case x.FileSize != size:
		return nil, badIndex("is for a %d-byte RAM file, the image's is %d", x.FileSize, size)
	case regionSize != RegionSize:
		return nil, badIndex("has regions of %d bytes, not %d", regionSize, RegionSize)
	case int(npacks) != len(packs) || npacks > maxPacks:
		return nil, badIndex("names %d packs, the manifest lists %d", npacks, len(packs))
	case int64(nregions) > (size+RegionSize-1)/RegionSize:
		return nil, badIndex("lists %d regions, more than the file has", nregions)
	}
	if err := x.readPacks(r, packs); err != nil {
		return nil, err
	}
	if err := x.readRegions(r, int(nregions)); err != nil {
		return nil, err
	}
	if len(r.b) != 0 {
		return nil, badIndex("has %d bytes after its last region", len(r.b))
	}
	return x, x.checkTiling()
}

// readPacks reads the pack list, which must be the manifest's.
func (x *Index) readPacks(r *indexReader, packs []ocispec.Descriptor) error {
	x.Packs = make([]PackRef, len(packs))
	for i := range x.Packs {
		sum := r.next(32)
		p := PackRef{Digest: digest.NewDigestFromBytes(digest.SHA256, sum), Size: int64(r.u64())}
		if r.bad {
			return badIndex("is cut short in its packs")
		}
		if p.Digest != packs[i].Digest || p.Size != packs[i].Size {
			return badIndex("names pack %d %s (%d bytes), the manifest's pack layer %d is %s (%d bytes)", i, p.Digest, p.Size, i, packs[i].Digest, packs[i].Size)
		}
		x.Packs[i] = p
	}
	return nil
}

// readRegions reads n regions and their frames.
func (x *Index) readRegions(r *indexReader, n int) error {
	x.Regions = make([]RegionEntry, 0, min(n, len(r.b)/indexRegionSize))
	next := int64(0)
	for range n {
		e := RegionEntry{Offset: int64(r.u64())}
		copy(e.Hash[:], r.next(32))
		frames := int(r.u16())
		switch {
		case r.bad:
			return badIndex("is cut short in its regions")
		case e.Offset < next || e.Offset%RegionSize != 0 || e.Offset >= x.FileSize:
			return badIndex("lists a region at offset %d: want a multiple of %d after the last one, inside the file", e.Offset, RegionSize)
		case frames < 1 || frames > MaxFrames:
			return badIndex("gives the region at %d %d frames: want 1..%d", e.Offset, frames, MaxFrames)
		}
		next = e.Offset + RegionSize
		e.Frames = make([]Frame, frames)
		for k := range e.Frames {
			f, err := x.readFrame(r, e.Offset)
			if err != nil {
				return err
			}
			if k > 0 && f.Pack <= e.Frames[k-1].Pack {
				return badIndex("gives the region at %d two frames in pack order %d then %d: want increasing packs", e.Offset, e.Frames[k-1].Pack, f.Pack)
			}
			e.Frames[k] = f
		}
		x.Regions = append(x.Regions, e)
	}
	return nil
}

// readFrame reads one frame of the region at off and checks its bounds.
func (x *Index) readFrame(r *indexReader, off int64) (Frame, error) {
	f := Frame{Pack: r.u16(), Offset: int64(r.u64()), Length: r.u32(), RawLength: r.u32()}
	copy(f.SHA256[:], r.next(32))
	raw := int(f.RawLength)
	switch {
	case r.bad:
		return f, badIndex("is cut short in the frames of region %d", off)
	case int(f.Pack) >= len(x.Packs):
		return f, badIndex("puts a frame of region %d in pack %d of %d", off, f.Pack, len(x.Packs))
	case f.Length == 0 || int(f.Length) > maxFrameLen:
		return f, badIndex("gives a frame of region %d %d bytes: want 1..%d", off, f.Length, maxFrameLen)
	case raw < headerSize || raw > maxRegionRaw || (raw-headerSize)%PageSize != 0:
		return f, badIndex("gives a frame of region %d a raw length of %d: want a header and whole pages, at most %d", off, raw, maxRegionRaw)
	case f.Offset < 0 || f.Offset+int64(f.Length) > x.Packs[f.Pack].Size:
		return f, badIndex("puts a frame of region %d at %d+%d, outside its %d-byte pack", off, f.Offset, f.Length, x.Packs[f.Pack].Size)
	}
	return f, nil
}

// checkTiling refuses packs that the frames do not tile exactly: every
// byte of a pack is one frame's, once.
func (x *Index) checkTiling() error {
	spans := make([][][2]int64, len(x.Packs))
	for _, r := range x.Regions {
		for _, f := range r.Frames {
			spans[f.Pack] = append(spans[f.Pack], [2]int64{f.Offset, f.Offset + int64(f.Length)})
		}
	}
	for p, s := range spans {
		slices.SortFunc(s, func(a, b [2]int64) int { return cmp.Compare(a[0], b[0]) })
		at := int64(0)
		for _, sp := range s {
			if sp[0] != at {
				return badIndex("leaves a gap or an overlap in pack %d at byte %d (a frame starts at %d)", p, at, sp[0])
			}
			at = sp[1]
		}
		if at != x.Packs[p].Size {
			return badIndex("covers %d of pack %d's %d bytes", at, p, x.Packs[p].Size)
		}
	}
	return nil
}
