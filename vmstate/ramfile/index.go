package ramfile

import (
	"crypto/sha256"
	"encoding/binary"

	"github.com/opencontainers/go-digest"
)

// The pack format (new checkpoints) stores a RAM file's regions as frames
// in a few large pack blobs, and says where each is in one index blob:
// a checkpoint or a cold prepare moves a handful of blobs instead of one
// per region, and a region can still be fetched alone, by a range request
// on its pack, and verified alone, by its frame's SHA-256 in the index.
// docs/image-format.md specifies it.

const (
	indexMagic = "VMSNIDX1"
	// MaxIndexBytes bounds an index once decompressed.
	MaxIndexBytes = 64 << 20
	// PackTarget is the size at which a writer closes a pack. Packs then
	// fit PutBlob's MaxChunkSize; a reader takes up to ociimage.MaxPackSize.
	PackTarget = 64 << 20
	// MaxFrames is the most frames one region may have: one per checkpoint
	// of a chain (a config lists at most 256).
	MaxFrames = 256
	// maxPacks: a frame names its pack in 16 bits.
	maxPacks = 1<<16 - 1
	// maxFrameLen bounds a frame: a region blob zstd could not shrink,
	// with zstd's block and frame headers.
	maxFrameLen = maxRegionRaw + 64<<10

	indexHeaderSize = len(indexMagic) + 8 + 4 + 4 + 4
	indexPackSize   = sha256.Size + 8
	indexRegionSize = 8 + sha256.Size + 2
	indexFrameSize  = 2 + 8 + 4 + 4 + sha256.Size
)

// Index is a decoded RAM index: the packs of the chain, and for every
// region that any checkpoint of the chain stored, its frames, oldest
// first, and the hash of its final content. A region it does not list
// is zeros.
type Index struct {
	FileSize int64
	Packs    []PackRef
	Regions  []RegionEntry // by offset
}

// PackRef is a pack as the index names it; it must be the manifest's
// pack layer of the same place.
type PackRef struct {
	Digest digest.Digest
	Size   int64
}

// RegionEntry is one region of the file.
type RegionEntry struct {
	Offset int64
	// Hash is the SHA-256 of the region's pages' strong hashes (16 bytes
	// each, zeros for a page of zeros; the pages inside the file): the
	// page map's word for what the region holds once every frame applied.
	Hash   [sha256.Size]byte
	Frames []Frame // oldest first, in strictly increasing packs
}

// Frame is one region blob in a pack.
type Frame struct {
	Pack      uint16 // the index's Packs
	Offset    int64  // in the pack
	Length    uint32 // compressed
	RawLength uint32 // the region blob's, decompressed
	SHA256    [sha256.Size]byte
}

// Encode is the index's binary form (before compression), little-endian
// (docs/image-format.md).
func (x *Index) Encode() []byte {
	b := make([]byte, 0, x.encodedSize())
	b = append(b, indexMagic...)
	b = binary.LittleEndian.AppendUint64(b, uint64(x.FileSize))
	b = binary.LittleEndian.AppendUint32(b, RegionSize)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(x.Packs)))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(x.Regions)))
	for _, p := range x.Packs {
		sum, _ := hexSum(p.Digest)
		b = append(b, sum[:]...)
		b = binary.LittleEndian.AppendUint64(b, uint64(p.Size))
	}
	for _, r := range x.Regions {
		b = binary.LittleEndian.AppendUint64(b, uint64(r.Offset))
		b = append(b, r.Hash[:]...)
		b = binary.LittleEndian.AppendUint16(b, uint16(len(r.Frames)))
		for _, f := range r.Frames {
			b = binary.LittleEndian.AppendUint16(b, f.Pack)
			b = binary.LittleEndian.AppendUint64(b, uint64(f.Offset))
			b = binary.LittleEndian.AppendUint32(b, f.Length)
			b = binary.LittleEndian.AppendUint32(b, f.RawLength)
			b = append(b, f.SHA256[:]...)
		}
	}
	return b
}

// encodedSize is how many bytes Encode gives.
func (x *Index) encodedSize() int {
	n := indexHeaderSize + len(x.Packs)*indexPackSize
	for _, r := range x.Regions {
		n += indexRegionSize + len(r.Frames)*indexFrameSize
	}
	return n
}

// hexSum is a sha256 digest's 32 bytes.
func hexSum(d digest.Digest) (s [sha256.Size]byte, ok bool) {
	if d.Algorithm() != digest.SHA256 || d.Validate() != nil {
		return s, false
	}
	enc := d.Encoded()
	for i := range s {
		hi, lo := unhex(enc[2*i]), unhex(enc[2*i+1])
		s[i] = hi<<4 | lo
	}
	return s, true
}

func unhex(c byte) byte {
	if c >= 'a' {
		return c - 'a' + 10
	}
	return c - '0'
}

// regionHash is a region's content hash from the strong hashes of its
// pages, page 0 of the region first.
func regionHash(strong func(k int) strongHash, pages int) [sha256.Size]byte {
	h := sha256.New()
	for k := range pages {
		s := strong(k)
		h.Write(s[:])
	}
	var out [sha256.Size]byte
	h.Sum(out[:0])
	return out
}

// pagesIn is how many of the region at off's pages lie in a file of size
// bytes.
func pagesIn(off, size int64) int {
	return int(min(RegionSize, size-off) / PageSize)
}

// mapRegionHash is the region at off's hash by the page map m.
func mapRegionHash(m *PageMap, off int64) [sha256.Size]byte {
	first := int(off / PageSize)
	return regionHash(func(k int) strongHash { return m.Strong(first + k) }, pagesIn(off, int64(m.Len())*PageSize))
}
