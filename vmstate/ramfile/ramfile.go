// Package ramfile stores a VM's RAM file page-addressed in an image store,
// and materializes it back into a file QEMU can map.
//
// A VM whose RAM is a memory-backend-file (mem-path=FILE,share=on) keeps
// every guest page at a fixed offset of FILE. vmsnap reads that file while
// the VM is stopped instead of having QEMU stream it, and stores it here:
//
//   - in fixed regions of RegionSize bytes, one blob each (a region layer:
//     a header naming its offset, a bitmap of the pages it holds, those
//     pages; zstd), so that a restore fetches, verifies and writes each
//     region on its own, at its place;
//   - zero pages are never stored;
//   - with a page map (two hashes per page, see PageMap), so that the next
//     checkpoint of the same VM finds the pages that changed by comparing
//     hashes, reading no blob, and stores only those: a delta whose region
//     layers come after its parent's in the manifest. Applying every region
//     layer in manifest order gives the file back.
//
// Which page changed is decided by the fast hash (xxhash64): a guest that
// makes a page collide with the hash of what its parent held at that
// address only loses its own write in its own snapshot. The parent's map
// is trusted only as far as the checkpoint verified it (Parent). Every
// region layer is verified by its sha256 digest before a byte of it is
// used, and the materialized file, page by page, against the image's map
// (Verify).
//
// It owns Scan and Shadow (the pages to store, from the stopped file or a
// pre-copy), Capture.Store (region and page-map layers), SplitLayers and
// LoadPageMap (a manifest's RAM layers checked before anything is fetched),
// Materialize, Verify, and Cache (the node's RAM files, one per image,
// named by its manifest digest, complete or absent, in a directory that
// must be the caller's own). It is not for QMP, QEMU's arguments or the
// compatibility check (package vmstate), nor for manifests and tags
// (package ociimage).
package ramfile

import (
	"crypto/sha256"
	"encoding/binary"
	"math/bits"
	"strconv"

	"github.com/cespare/xxhash/v2"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

const (
	// PageSize is the granularity of the page map and of deltas: x86's
	// base page, QEMU's target page size for every machine vmsnap records.
	PageSize = 4096
	// RegionSize is the address range one region layer covers. 2 MiB keeps
	// a 4 GiB guest's base under 2048 layers and a layer's blob small
	// enough to fetch and verify in one piece.
	RegionSize     = 2 << 20
	pagesPerRegion = RegionSize / PageSize

	// regionMagic starts every region blob (before compression).
	regionMagic = "VMSNRAM1"
	// headerSize: magic, the region's offset (uint64 LE), the page bitmap.
	headerSize = len(regionMagic) + 8 + pagesPerRegion/8
	// maxRegionRaw is the largest a region blob can be once decompressed.
	maxRegionRaw = headerSize + RegionSize

	// MaxRAMBytes bounds the RAM file an image may declare (1 TiB): it
	// sizes the page map vmsnap holds (24 bytes a page).
	MaxRAMBytes = 1 << 40
	// MaxRegionLayers is how many region layers one manifest may list,
	// parents' included: a layer's descriptor takes about 250 bytes of a
	// manifest, which may not pass ociimage.MaxManifestSize (4 MiB).
	MaxRegionLayers = 12000
	// MaxFileBytes is the largest RAM file whose base fits in
	// MaxRegionLayers (23 GiB): the memory-file format holds guests up to
	// that size.
	MaxFileBytes = MaxRegionLayers * RegionSize
	// pageMapPiece is how many pages one page-map layer covers (24 MiB of
	// hashes for 4 GiB of RAM).
	pageMapPiece = 1 << 20
)

// A page map has two hashes per page, 24 bytes in all:
//
//   - fast: xxhash64, computed for every page while the VM is stopped, to
//     find the pages that changed since the parent (0 for a page of zeros;
//     a data page hashing to 0 is entered as 1);
//   - strong: the first 16 bytes of its SHA-256, computed after the VM
//     runs again for the pages it stored, and taken over from the parent
//     for the others (zeros for a page of zeros).
//
// A prepare checks every page of the file it materialized against both
// hashes of the image's own map (Verify): a parent whose layers do not hold
// what its map says gives a file that fails that check, instead of a VM
// running someone else's memory.
const entrySize = 8 + strongSize

const strongSize = 16

type strongHash [strongSize]byte

func fastHash(p []byte) uint64 {
	// Most of a guest's pages are zero: comparing is cheaper than hashing,
	// and stops at the first byte of a page of data.
	if isZero(p) {
		return 0
	}
	h := xxhash.Sum64(p)
	if h == 0 {
		return 1
	}
	return h
}

func strongHashOf(p []byte) strongHash {
	sum := sha256.Sum256(p)
	return strongHash(sum[:strongSize])
}

var zeroPage [PageSize]byte

func isZero(p []byte) bool {
	for len(p) >= PageSize {
		if string(p[:PageSize]) != string(zeroPage[:]) {
			return false
		}
		p = p[PageSize:]
	}
	return string(p) == string(zeroPage[:len(p)])
}

// PageMap holds the hashes of a RAM file's data pages: a bit per page says
// which pages hold data, and their two hashes are kept in page order,
// found by rank. It takes 24 bytes per data page and a bit per page, so it
// grows with the guest's data, not its size. Pages are added in order
// (add), then finish makes it ready for lookups.
type PageMap struct {
	pages  int
	bits   []uint64 // bit i%64 of word i/64: page i holds data
	ranks  []uint32 // data pages before each word
	fast   []uint64
	strong []strongHash
}

func newPageMap(pages int) *PageMap {
	return &PageMap{pages: pages, bits: make([]uint64, (pages+63)/64)}
}

// add enters data page i (after every page added before it) with its fast
// hash.
func (m *PageMap) add(i int, fast uint64) {
	m.bits[i/64] |= 1 << (i % 64)
	m.fast = append(m.fast, fast)
	m.strong = append(m.strong, strongHash{})
}

// finish computes the ranks; call it once every page is added.
func (m *PageMap) finish() {
	m.ranks = make([]uint32, len(m.bits))
	n := uint32(0)
	for w, b := range m.bits {
		m.ranks[w] = n
		n += uint32(bits.OnesCount64(b))
	}
}

// Len is how many pages the map covers.
func (m *PageMap) Len() int { return m.pages }

// DataPages is how many pages hold data.
func (m *PageMap) DataPages() int { return len(m.fast) }

// IsZero says whether page i is a page of zeros.
func (m *PageMap) IsZero(i int) bool { return m.bits[i/64]&(1<<(i%64)) == 0 }

// index is data page i's place among the data pages.
func (m *PageMap) index(i int) int {
	return int(m.ranks[i/64]) + bits.OnesCount64(m.bits[i/64]&(1<<(i%64)-1))
}

// Fast is page i's fast hash, 0 for a page of zeros.
func (m *PageMap) Fast(i int) uint64 {
	if m.IsZero(i) {
		return 0
	}
	return m.fast[m.index(i)]
}

// Strong is page i's strong hash, zeros for a page of zeros.
func (m *PageMap) Strong(i int) strongHash {
	if m.IsZero(i) {
		return strongHash{}
	}
	return m.strong[m.index(i)]
}

// Pages is how many pages a RAM file of size bytes has.
func Pages(size int64) int { return int((size + PageSize - 1) / PageSize) }

// CheckSize refuses a RAM size vmsnap will not store or materialize.
func CheckSize(size int64) error {
	if size <= 0 || size > MaxRAMBytes || size%PageSize != 0 {
		return errcode.New(errcode.InvalidInput, "RAM file of %d bytes: want a multiple of %d up to %d", size, PageSize, int64(MaxRAMBytes))
	}
	return nil
}

// regionHeader encodes the header of the region at offset holding the
// pages set in bitmap.
func regionHeader(offset int64, bitmap *[pagesPerRegion / 8]byte) []byte {
	h := make([]byte, 0, headerSize)
	h = append(h, regionMagic...)
	h = binary.LittleEndian.AppendUint64(h, uint64(offset))
	return append(h, bitmap[:]...)
}

// region is a decoded region blob.
type region struct {
	offset int64
	bitmap []byte // pagesPerRegion bits, page i of the region in bit i%8 of byte i/8
	pages  []byte // the pages set in bitmap, in order
}

func (r region) has(i int) bool { return r.bitmap[i/8]&(1<<(i%8)) != 0 }

// parseRegion checks a decompressed region blob, named name, against
// the offset its layer or index entry declares (want) and the RAM file's
// size: the header, the offset, and that it holds exactly the pages its
// bitmap sets, all inside the file.
func parseRegion(raw []byte, name string, want, ramSize int64) (region, error) {
	bad := func(format string, args ...any) (region, error) {
		return region{}, errcode.New(errcode.InvalidInput, "RAM region %s: "+format, append([]any{name}, args...)...)
	}
	if len(raw) < headerSize || string(raw[:len(regionMagic)]) != regionMagic {
		return bad("not a region blob")
	}
	off := int64(binary.LittleEndian.Uint64(raw[len(regionMagic):]))
	if off != want {
		return bad("holds offset %d, its layer declares %d", off, want)
	}
	r := region{offset: off, bitmap: raw[len(regionMagic)+8 : headerSize], pages: raw[headerSize:]}
	n := 0
	for i := range pagesPerRegion {
		if r.has(i) {
			if off+int64(i+1)*PageSize > ramSize {
				return bad("page %d lies beyond the %d-byte RAM file", i, ramSize)
			}
			n++
		}
	}
	if len(r.pages) != n*PageSize {
		return bad("bitmap sets %d pages, blob holds %d bytes of pages", n, len(r.pages))
	}
	return r, nil
}

// RegionOffset is the offset a region layer declares, which must be a
// multiple of RegionSize.
func RegionOffset(desc ocispec.Descriptor) (int64, error) {
	s := desc.Annotations[ociimage.AnnotationRAMOffset]
	off, err := strconv.ParseInt(s, 10, 64)
	if err != nil || off < 0 || off%RegionSize != 0 || off >= MaxRAMBytes {
		return 0, errcode.New(errcode.InvalidInput, "RAM region %s declares offset %q: want a multiple of %d", desc.Digest, s, RegionSize)
	}
	return off, nil
}

// Layers is a memory-file image's RAM layers, split by kind. An image is
// in the pack format (Index set, Packs) or the region-layer format of
// earlier versions (Regions), never both.
type Layers struct {
	PageMap []ocispec.Descriptor // in page order
	Regions []ocispec.Descriptor // in the order they apply: a base's, then each delta's
	Index   *ocispec.Descriptor  // the chain's index (pack format)
	Packs   []ocispec.Descriptor // the chain's packs, a base's first, in the index's order
}

// SplitLayers validates the RAM layers of a manifest (media types, sizes,
// offsets, a page map that covers the file exactly, one format) before
// anything is fetched.
func SplitLayers(layers []ocispec.Descriptor, ramSize int64) (Layers, error) {
	var out Layers
	if err := CheckSize(ramSize); err != nil {
		return out, err
	}
	next := 0
	for i, l := range layers {
		if err := out.add(i, l, ramSize, &next); err != nil {
			return out, err
		}
	}
	if pages := Pages(ramSize); next != pages {
		return out, errcode.New(errcode.InvalidInput, "the page map covers %d of the RAM file's %d pages", next, pages)
	}
	if out.Index == nil && len(out.Packs) > 0 || out.Index != nil && len(out.Regions) > 0 {
		return out, errcode.New(errcode.InvalidInput, "the image's RAM layers mix formats: packs need one index, and region layers none")
	}
	return out, nil
}

// add checks layer i and files it by kind; next is the page the next page
// map layer must start at.
func (out *Layers) add(i int, l ocispec.Descriptor, ramSize int64, next *int) error {
	limit := int64(ociimage.MaxChunkSize)
	if l.MediaType == ociimage.MediaTypeRAMPack {
		limit = ociimage.MaxPackSize
	}
	if l.Size <= 0 || l.Size > limit {
		return errcode.New(errcode.InvalidInput, "RAM layer %d declares %d bytes: want 1..%d", i, l.Size, limit)
	}
	if err := l.Digest.Validate(); err != nil {
		return errcode.Wrap(errcode.InvalidInput, err, "RAM layer %d", i)
	}
	switch l.MediaType {
	case ociimage.MediaTypeRAMPageMap:
		first, count, err := pageMapRange(l)
		if err != nil {
			return err
		}
		if first != *next || count <= 0 || count > pageMapPiece || first+count > Pages(ramSize) {
			return errcode.New(errcode.InvalidInput, "page map layer %d covers pages %d+%d, want the next from page %d of %d", i, first, count, *next, Pages(ramSize))
		}
		*next += count
		out.PageMap = append(out.PageMap, l)
	case ociimage.MediaTypeRAMRegion:
		off, err := RegionOffset(l)
		if err != nil {
			return err
		}
		if _, err := rawRegionSize(l); err != nil {
			return err
		}
		if off >= ramSize {
			return errcode.New(errcode.InvalidInput, "RAM region layer %d at offset %d lies beyond the %d-byte RAM file", i, off, ramSize)
		}
		out.Regions = append(out.Regions, l)
	case ociimage.MediaTypeRAMIndex:
		if out.Index != nil {
			return errcode.New(errcode.InvalidInput, "RAM layer %d is a second index: an image has one", i)
		}
		out.Index = &l
	case ociimage.MediaTypeRAMPack:
		out.Packs = append(out.Packs, l)
	default:
		return errcode.New(errcode.InvalidInput, "layer %d has media type %q, not a RAM layer", i, l.MediaType)
	}
	return nil
}

func pageMapRange(l ocispec.Descriptor) (first, count int, err error) {
	a, errA := strconv.Atoi(l.Annotations[ociimage.AnnotationRAMFirstPage])
	b, errB := strconv.Atoi(l.Annotations[ociimage.AnnotationRawSize])
	if errA != nil || errB != nil || a < 0 || b <= 0 || b%entrySize != 0 || b/entrySize > pageMapPiece {
		return 0, 0, errcode.New(errcode.InvalidInput, "page map layer %s has no valid %s and %s", l.Digest, ociimage.AnnotationRAMFirstPage, ociimage.AnnotationRawSize)
	}
	return a, b / entrySize, nil
}

// IsRAMLayer says whether a layer belongs to the RAM file rather than to
// QEMU's device state stream.
func IsRAMLayer(l ocispec.Descriptor) bool {
	switch l.MediaType {
	case ociimage.MediaTypeRAMRegion, ociimage.MediaTypeRAMPageMap, ociimage.MediaTypeRAMIndex, ociimage.MediaTypeRAMPack:
		return true
	}
	return false
}

func pageMapDesc(first, count int, data []byte) ocispec.Descriptor {
	d := blobDesc(ociimage.MediaTypeRAMPageMap, data)
	d.Annotations = map[string]string{
		ociimage.AnnotationRAMFirstPage: strconv.Itoa(first),
		ociimage.AnnotationRawSize:      strconv.Itoa(count * entrySize),
	}
	return d
}

func regionDesc(offset int64, rawLen int, data []byte) ocispec.Descriptor {
	d := blobDesc(ociimage.MediaTypeRAMRegion, data)
	d.Annotations = map[string]string{
		ociimage.AnnotationRAMOffset: strconv.FormatInt(offset, 10),
		ociimage.AnnotationRawSize:   strconv.Itoa(rawLen),
	}
	return d
}
