package disk

import (
	"bytes"
	"encoding/binary"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// readFixed reads the magic, the version and the fixed part of the header
// (the version says how long it is) into h.
func (h *Header) readFixed(hr headerReader) error {
	b, err := hr.read(0, 8, "magic and version")
	if err != nil {
		return err
	}
	if !bytes.Equal(b[:4], []byte("QFI\xfb")) {
		return errcode.New(errcode.InvalidInput,
			"not a qcow2 image (magic %q): vmsnap needs the VM's qcow2 overlay; create one with `qemu-img create -f qcow2 -b BASE -F FMT OVERLAY`", b[:4])
	}
	h.Version = uint64(binary.BigEndian.Uint32(b[4:8]))
	var fixed int
	switch h.Version {
	case 2:
		fixed = v2HeaderLength
	case 3:
		fixed = v3MinHeaderLength
	default:
		return errcode.New(errcode.InvalidInput,
			"unsupported qcow2 version %d: vmsnap reads versions 2 and 3; convert the image with `qemu-img convert -O qcow2 -o compat=1.1`", h.Version)
	}
	b, err = hr.read(0, fixed, "fixed header")
	if err != nil {
		return err
	}
	h.decodeFixed(b)
	return nil
}

// decodeFixed sets h's fields from the fixed header b, which is as long as
// h.Version says.
func (h *Header) decodeFixed(b []byte) {
	be := binary.BigEndian
	h.BackingFileOffset = be.Uint64(b[8:16])
	h.BackingFileSize = be.Uint32(b[16:20])
	h.ClusterBits = uint64(be.Uint32(b[20:24]))
	h.VirtualSize = be.Uint64(b[24:32])
	h.CryptMethod = be.Uint32(b[32:36])
	h.L1Size = be.Uint32(b[36:40])
	h.L1TableOffset = be.Uint64(b[40:48])
	h.RefcountTableOffset = be.Uint64(b[48:56])
	h.RefcountTableClusters = be.Uint32(b[56:60])
	h.NbSnapshots = be.Uint32(b[60:64])
	h.SnapshotsOffset = be.Uint64(b[64:72])
	if h.Version == 2 {
		// Version 2 has no feature fields; its refcounts are always 16 bits.
		h.HeaderLength = v2HeaderLength
		h.RefcountOrder = 4
		return
	}
	h.IncompatibleFeatures = be.Uint64(b[72:80])
	h.CompatibleFeatures = be.Uint64(b[80:88])
	h.AutoclearFeatures = be.Uint64(b[88:96])
	h.RefcountOrder = be.Uint32(b[96:100])
	h.HeaderLength = be.Uint32(b[100:104])
}

// checkFixed checks the fixed header's sizes and methods, and reads the
// compression type of a version 3 header long enough to have one.
func (h *Header) checkFixed(hr headerReader) error {
	if h.ClusterBits < MinClusterBits || h.ClusterBits > MaxClusterBits {
		return malformed("cluster_bits %d is outside %d..%d", h.ClusterBits, MinClusterBits, MaxClusterBits)
	}
	if h.Version == 3 {
		if err := h.checkV3(hr); err != nil {
			return err
		}
	}
	if h.VirtualSize > MaxVirtualSize {
		return malformed("virtual size %d is above vmsnap's limit of 2^56 bytes", h.VirtualSize)
	}
	if h.CryptMethod > CryptLUKS {
		return malformed("crypt_method %d is not 0 (none), 1 (AES) or 2 (LUKS)", h.CryptMethod)
	}
	return nil
}

// checkV3 checks the header length and refcount order a version 3 header
// declares, and reads its compression type if it has one.
func (h *Header) checkV3(hr headerReader) error {
	cluster := h.ClusterSize()
	if h.HeaderLength < v3MinHeaderLength || h.HeaderLength%8 != 0 {
		return malformed("header_length %d is not a multiple of 8 of at least %d", h.HeaderLength, v3MinHeaderLength)
	}
	if uint64(h.HeaderLength) > cluster {
		return malformed("header_length %d exceeds the %d-byte cluster", h.HeaderLength, cluster)
	}
	if uint64(h.HeaderLength) > uint64(hr.size) {
		return malformed("the %d-byte file is shorter than its %d-byte header", hr.size, h.HeaderLength)
	}
	if h.RefcountOrder > 6 {
		return malformed("refcount_order %d is above 6 (64-bit refcounts)", h.RefcountOrder)
	}
	if h.HeaderLength > v3MinHeaderLength {
		c, err := hr.read(v3MinHeaderLength, 1, "compression type")
		if err != nil {
			return err
		}
		h.CompressionType = c[0]
	}
	return nil
}

// extensionAreaEnd is where the header extensions must end: the end of the
// first cluster, or the backing file name if that comes first, or the end
// of the file if that comes first.
func (h *Header) extensionAreaEnd(fileSize int64) uint64 {
	areaEnd := h.ClusterSize()
	if h.BackingFileOffset != 0 && h.BackingFileOffset < areaEnd {
		areaEnd = h.BackingFileOffset
	}
	if uint64(fileSize) < areaEnd {
		areaEnd = uint64(fileSize)
	}
	return areaEnd
}
