// Package disk is the VM's writable qcow2 overlay: ReadHeader/Validate
// refuse what cannot be carried safely (docs/errors-and-guarantees.md lists
// it), CheckBacking, Capture, and Restore (atomic and sparse, before QEMU
// starts). Not for base images, a running VM's disk, repairing qcow2
// metadata, or formats other than qcow2.
package disk

// This file reads and judges the overlay's qcow2 header, written from
// QEMU's docs/interop/qcow2.txt.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Limits on what ReadHeader accepts. They are QEMU's own limits where QEMU has
// one, so that every image QEMU opens passes, and sanity caps otherwise so
// that a hostile header cannot make vmsnap allocate or compute absurdly.
const (
	MinClusterBits = 9  // 512-byte clusters: the smallest the format allows
	MaxClusterBits = 21 // 2 MiB clusters: QEMU refuses to open larger ones

	// MaxVirtualSize is a sanity cap (64 PiB), well above any disk vmsnap
	// will meet and far enough below 2^63 that offset arithmetic cannot wrap.
	MaxVirtualSize = 1 << 56

	// MaxBackingFileName is the longest backing file name the spec allows.
	MaxBackingFileName = 1023

	v2HeaderLength    = 72
	v3MinHeaderLength = 104
	maxL1Entries      = 32 << 20 / 8 // QEMU refuses an active L1 table over 32 MiB
	maxSnapshots      = 65536        // QEMU's cap on internal snapshots
	maxFormatName     = 15           // QEMU keeps the backing format in a 16-byte buffer
	featureEntrySize  = 48
)

// Incompatible feature bits. An image with a bit set that a reader does not
// understand must not be opened, so ReadHeader refuses any bit not listed.
const (
	IncompatDirty           = 1 << 0 // refcounts may be stale: not closed cleanly
	IncompatCorrupt         = 1 << 1 // QEMU found corruption and stopped writing
	IncompatExternalData    = 1 << 2 // guest data lives in another file
	IncompatCompressionType = 1 << 3 // compression_type field is not zlib
	IncompatExtendedL2      = 1 << 4 // L2 entries carry subcluster bitmaps

	knownIncompat = IncompatDirty | IncompatCorrupt | IncompatExternalData |
		IncompatCompressionType | IncompatExtendedL2
)

// Compatible and autoclear feature bits that vmsnap reports. Unknown bits of
// either kind are harmless to a reader by definition and are kept as read.
const (
	CompatLazyRefcounts      = 1 << 0
	AutoclearBitmaps         = 1 << 0 // the bitmaps extension is consistent
	AutoclearRawExternalData = 1 << 1 // the external data file is a valid raw image
)

// Values of crypt_method.
const (
	CryptNone = 0
	CryptAES  = 1 // legacy, QEMU refuses to create it nowadays
	CryptLUKS = 2
)

// Values of compression_type.
const (
	CompressionZlib = 0
	CompressionZstd = 1
)

// Header extension types vmsnap understands.
const (
	extEnd          = 0x00000000
	extBackingFmt   = 0xe2792aca
	extFeatureNames = 0x6803f857
	extBitmaps      = 0x23852875
	extEncryption   = 0x0537be77
	extDataFile     = 0x44415441
)

// Header is the parsed header of a qcow2 image: its fixed fields, the header
// extensions vmsnap understands, and the backing file name.
type Header struct {
	Version     uint64 // 2 or 3
	ClusterBits uint64 // MinClusterBits..MaxClusterBits
	VirtualSize uint64 // guest-visible disk size in bytes

	// BackingFile is the backing file name exactly as stored: QEMU resolves
	// a relative name against the overlay's directory. Empty without one.
	BackingFile string
	// BackingFormat comes from the backing format extension; empty when the
	// image does not record it and QEMU would have to probe.
	BackingFormat string

	CryptMethod uint32 // CryptNone, CryptAES or CryptLUKS

	IncompatibleFeatures uint64
	CompatibleFeatures   uint64
	AutoclearFeatures    uint64

	HeaderLength    uint32 // 72 for version 2; >= 104 and a multiple of 8 for 3
	RefcountOrder   uint32 // refcounts are 1<<RefcountOrder bits wide
	CompressionType uint8  // CompressionZlib or CompressionZstd
	NbSnapshots     uint32 // internal snapshots

	// ExternalDataFile is the name from the external data file extension.
	// It may be empty even when ExternalData is set: QEMU then needs the
	// name on its command line.
	ExternalDataFile string

	Dirty        bool // IncompatDirty
	Corrupt      bool // IncompatCorrupt
	ExternalData bool // IncompatExternalData
	ExtendedL2   bool // IncompatExtendedL2

	// EncryptionHeader reports a full disk encryption header extension.
	EncryptionHeader bool
	// HasBitmaps reports a bitmaps extension; NbBitmaps is its count.
	HasBitmaps bool
	NbBitmaps  uint32
	// FeatureNames is the image's own feature name table, used to name
	// feature bits vmsnap does not know.
	FeatureNames []FeatureName

	// Table locations, checked for alignment and kept for whoever packages
	// the image.
	L1Size                uint32
	L1TableOffset         uint64
	RefcountTableOffset   uint64
	RefcountTableClusters uint32
	SnapshotsOffset       uint64
	BackingFileOffset     uint64
	BackingFileSize       uint32
}

// FeatureName is one entry of the feature name table extension.
type FeatureName struct {
	Type uint8 // 0 incompatible, 1 compatible, 2 autoclear
	Bit  uint8
	Name string
}

// ClusterSize is the image's cluster size in bytes.
func (h Header) ClusterSize() uint64 { return 1 << h.ClusterBits }

// Encrypted reports whether the guest data is encrypted by either method.
func (h Header) Encrypted() bool { return h.CryptMethod != CryptNone || h.EncryptionHeader }

// malformed is the error for a header that breaks the format: there is
// nothing to fix in vmsnap, only the file to check.
func malformed(format string, args ...any) error {
	return errcode.New(errcode.InvalidInput,
		"malformed qcow2 header: %s (the file is damaged or not a qcow2 image written by QEMU; inspect it with `qemu-img check`)",
		fmt.Sprintf(format, args...))
}

// headerReader reads ranges of the image, refusing any that reach past the
// size the caller gave before allocating, so that no field of the file
// decides how much memory is allocated.
type headerReader struct {
	r    io.ReaderAt
	size int64
}

func (hr headerReader) read(off uint64, n int, what string) ([]byte, error) {
	if n < 0 || off > uint64(hr.size) || uint64(n) > uint64(hr.size)-off {
		return nil, malformed("%s (%d bytes at offset %d) lies beyond the end of the %d-byte file", what, n, off, hr.size)
	}
	buf := make([]byte, n)
	got, err := hr.r.ReadAt(buf, int64(off))
	if got == n {
		// A ReaderAt may report io.EOF alongside a full read at the end.
		return buf, nil
	}
	if err == nil || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return nil, malformed("the file ended inside %s at offset %d, before its reported size of %d bytes", what, off, hr.size)
	}
	return nil, errcode.Wrap(errcode.Internal, err, "reading the qcow2 %s", what)
}

// ReadHeader parses and checks the header of the qcow2 image r, which is
// fileSize bytes long. It refuses (INVALID_INPUT) anything that is not a
// well-formed version 2 or 3 header, and any incompatible feature it does not
// know; it does not judge whether vmsnap may capture the image (Validate).
// Only the header cluster and the backing file name are read.
func ReadHeader(r io.ReaderAt, fileSize int64) (Header, error) {
	var h Header
	if fileSize < 0 {
		return h, errcode.New(errcode.Internal, "qcow2: negative file size %d", fileSize)
	}
	hr := headerReader{r: r, size: fileSize}
	if fileSize < 8 {
		return h, errcode.New(errcode.InvalidInput,
			"not a qcow2 image: the file is only %d bytes long; vmsnap needs the VM's qcow2 overlay", fileSize)
	}
	if err := h.readFixed(hr); err != nil {
		return h, err
	}
	if err := h.checkFixed(hr); err != nil {
		return h, err
	}
	if err := h.checkTables(); err != nil {
		return h, err
	}
	if err := h.readExtensions(hr, uint64(h.HeaderLength), h.extensionAreaEnd(fileSize)); err != nil {
		return h, err
	}
	if err := h.checkFeatures(); err != nil {
		return h, err
	}
	if err := h.readBackingName(hr); err != nil {
		return h, err
	}
	return h, nil
}

// checkTables checks the table fields QEMU checks on open. vmsnap copies the
// image as bytes and never walks these tables; the checks are there so that a
// header QEMU would refuse is refused before it is captured or restored.
func (h *Header) checkTables() error {
	cluster := h.ClusterSize()
	aligned := func(name string, off uint64) error {
		if off%cluster != 0 {
			return malformed("%s %d is not aligned to the %d-byte cluster", name, off, cluster)
		}
		return nil
	}
	if h.RefcountTableClusters == 0 {
		return malformed("the image has no refcount table")
	}
	if h.RefcountTableOffset == 0 {
		return malformed("the refcount table overlaps the header")
	}
	if err := aligned("refcount_table_offset", h.RefcountTableOffset); err != nil {
		return err
	}
	if err := aligned("l1_table_offset", h.L1TableOffset); err != nil {
		return err
	}
	if h.L1Size > maxL1Entries {
		return malformed("l1_size %d is above QEMU's limit of %d entries", h.L1Size, maxL1Entries)
	}
	// Each L2 table covers cluster/entry clusters; entries are 8 bytes, or
	// 16 with extended L2. Both factors are small, so no overflow.
	entry := uint64(8)
	if h.IncompatibleFeatures&IncompatExtendedL2 != 0 {
		entry = 16
	}
	perL1 := cluster * (cluster / entry)
	if need := (h.VirtualSize + perL1 - 1) / perL1; uint64(h.L1Size) < need {
		return malformed("l1_size %d is too small for a virtual size of %d bytes (needs %d)", h.L1Size, h.VirtualSize, need)
	}
	if h.NbSnapshots > maxSnapshots {
		return malformed("nb_snapshots %d is above QEMU's limit of %d", h.NbSnapshots, maxSnapshots)
	}
	if h.NbSnapshots > 0 {
		if err := aligned("snapshots_offset", h.SnapshotsOffset); err != nil {
			return err
		}
	}
	return nil
}

// readExtensions walks the header extensions in [off, end). Every length is
// checked against end (at most one cluster, 2 MiB) before data is read.
func (h *Header) readExtensions(hr headerReader, off, end uint64) error {
	be := binary.BigEndian
	seen := map[uint32]bool{}
	for off < end {
		if end-off < 8 {
			return malformed("the header extension at offset %d is cut off by the end of the extension area at %d", off, end)
		}
		b, err := hr.read(off, 8, "header extension")
		if err != nil {
			return err
		}
		typ, n := be.Uint32(b[:4]), uint64(be.Uint32(b[4:8]))
		off += 8
		if typ == extEnd {
			return nil
		}
		if n > end-off {
			return malformed("header extension 0x%08x at offset %d claims %d bytes, past the end of the extension area at %d",
				typ, off-8, n, end)
		}
		dataOff := off
		// Data is padded to 8 bytes; padding may run into the end of the
		// area, which simply ends the walk.
		off += (n + 7) &^ 7
		switch typ {
		case extBackingFmt, extFeatureNames, extBitmaps, extEncryption, extDataFile:
		default:
			continue // unknown extensions carry nothing a reader must obey
		}
		// The spec allows each type once; a second copy is ambiguous.
		if seen[typ] {
			return malformed("header extension 0x%08x appears twice", typ)
		}
		seen[typ] = true
		data, err := hr.read(dataOff, int(n), fmt.Sprintf("header extension 0x%08x", typ))
		if err != nil {
			return err
		}
		switch typ {
		case extBackingFmt:
			if n == 0 || n > maxFormatName {
				return malformed("backing format name is %d bytes long, not 1..%d", n, maxFormatName)
			}
			h.BackingFormat = string(data)
		case extDataFile:
			h.ExternalDataFile = string(data)
		case extEncryption:
			if n != 16 {
				return malformed("full disk encryption extension is %d bytes long, not 16", n)
			}
			h.EncryptionHeader = true
		case extBitmaps:
			if n != 24 {
				return malformed("bitmaps extension is %d bytes long, not 24", n)
			}
			h.HasBitmaps = true
			h.NbBitmaps = be.Uint32(data[:4])
		case extFeatureNames:
			// A trailing partial entry is ignored, as QEMU does.
			for i := 0; i+featureEntrySize <= len(data); i += featureEntrySize {
				e := data[i : i+featureEntrySize]
				name, _, _ := bytes.Cut(e[2:], []byte{0})
				h.FeatureNames = append(h.FeatureNames, FeatureName{Type: e[0], Bit: e[1], Name: string(name)})
			}
		}
	}
	return nil
}

// checkFeatures decodes the feature bits and refuses combinations QEMU would
// refuse, naming unknown bits from the image's own table where it has one.
func (h *Header) checkFeatures() error {
	f := h.IncompatibleFeatures
	if unknown := f &^ knownIncompat; unknown != 0 {
		var names []string
		for bit := range 64 {
			if unknown&(1<<bit) == 0 {
				continue
			}
			name := fmt.Sprintf("bit %d", bit)
			for _, fn := range h.FeatureNames {
				if fn.Type == 0 && int(fn.Bit) == bit && fn.Name != "" {
					name = fmt.Sprintf("bit %d (%q)", bit, fn.Name)
				}
			}
			names = append(names, name)
		}
		return errcode.New(errcode.InvalidInput,
			"qcow2 image uses incompatible features vmsnap does not support: %s; convert it with `qemu-img convert -O qcow2` to drop them",
			strings.Join(names, ", "))
	}
	h.Dirty = f&IncompatDirty != 0
	h.Corrupt = f&IncompatCorrupt != 0
	h.ExternalData = f&IncompatExternalData != 0
	h.ExtendedL2 = f&IncompatExtendedL2 != 0

	switch {
	case f&IncompatCompressionType != 0 && h.CompressionType == CompressionZlib:
		return malformed("the compression type feature bit is set but compression_type is zlib")
	case f&IncompatCompressionType == 0 && h.CompressionType != CompressionZlib:
		return malformed("compression_type is %d but the compression type feature bit is not set", h.CompressionType)
	case h.CompressionType > CompressionZstd:
		return errcode.New(errcode.InvalidInput,
			"qcow2 compression type %d is not zlib (0) or zstd (1); convert the image with `qemu-img convert -O qcow2`", h.CompressionType)
	}
	if h.ExternalDataFile != "" && !h.ExternalData {
		return malformed("the image names an external data file but the external data feature bit is not set")
	}
	// Autoclear bits are advisory (a writer that does not know one clears
	// it), so they are kept as read and never refused.
	return nil
}

// readBackingName reads the backing file name. QEMU keeps it in the first
// cluster after the extensions; one elsewhere would overlap the data vmsnap
// treats as opaque, so it is refused.
func (h *Header) readBackingName(hr headerReader) error {
	if h.BackingFileOffset == 0 {
		// No backing file; the size field means nothing then.
		return nil
	}
	off, n := h.BackingFileOffset, uint64(h.BackingFileSize)
	if n > MaxBackingFileName {
		return malformed("backing file name is %d bytes long, above the limit of %d", n, MaxBackingFileName)
	}
	if off < uint64(h.HeaderLength) {
		return malformed("backing file name at offset %d overlaps the %d-byte header", off, h.HeaderLength)
	}
	if cluster := h.ClusterSize(); off > cluster || n > cluster-off {
		return malformed("backing file name (%d bytes at offset %d) is not within the first %d-byte cluster", n, off, cluster)
	}
	b, err := hr.read(off, int(n), "backing file name")
	if err != nil {
		return err
	}
	h.BackingFile = string(b)
	return nil
}

// Validate reports whether vmsnap may capture or restore this image as a VM's
// writable overlay. Every problem found is listed, each with how to fix it.
func (h Header) Validate() error {
	var problems []string
	if h.Dirty {
		problems = append(problems, "the image was not closed cleanly (dirty bit set); stop the VM or run `qemu-img check -r all OVERLAY`")
	}
	if h.Corrupt {
		problems = append(problems, "QEMU marked the image corrupt; repair it with `qemu-img check -r all OVERLAY` or restore it from a good copy")
	}
	if h.Encrypted() {
		problems = append(problems, "the image is encrypted, which vmsnap does not support; make an unencrypted copy with `qemu-img convert -O qcow2` (with --object secret and --image-opts to unlock it)")
	}
	if h.ExternalData {
		problems = append(problems, "the image keeps its data in an external data file, which vmsnap would not capture; fold it into the image with `qemu-img convert -O qcow2 OVERLAY NEW`")
	}
	if h.BackingFile != "" {
		if p := backingNameProblem(h.BackingFile); p != "" {
			problems = append(problems, p)
		} else if h.BackingFormat == "" {
			problems = append(problems, fmt.Sprintf(
				"the backing file %q has no recorded format, so QEMU would probe it; record it with `qemu-img rebase -u -b %s -F FMT OVERLAY` (FMT is raw or qcow2)",
				h.BackingFile, h.BackingFile))
		}
	}
	if len(problems) > 0 {
		return errcode.WithDetails(errcode.InvalidInput, problems, "the qcow2 overlay cannot be captured or restored")
	}
	return nil
}

// backingNameProblem says why a backing file name cannot travel with the
// overlay, or returns "". The overlay is restored into a new directory with
// its base beside it, so the name must be relative and stay in that
// directory. A name with a colon before any slash is also refused: QEMU reads
// it as a protocol ("nbd:", "json:"), not a file.
func backingNameProblem(name string) string {
	fix := fmt.Sprintf("make it relative to the overlay's directory with `qemu-img rebase -u -b RELATIVE -F FMT OVERLAY` (currently %q)", name)
	switch {
	case strings.IndexByte(name, 0) >= 0:
		return "the backing file name contains a NUL byte; " + fix
	case filepath.IsAbs(name):
		return "the backing file name is absolute, so the overlay cannot be restored elsewhere; " + fix
	case !filepath.IsLocal(name):
		return "the backing file name leaves the overlay's directory; " + fix
	case slices.Contains(strings.Split(filepath.ToSlash(name), "/"), ".."):
		// IsLocal judges "sub/../base" lexically, but the kernel needs sub
		// to exist and follows it if it is a symlink: the two can disagree.
		return "the backing file name contains \"..\"; " + fix
	}
	if colon := strings.IndexByte(name, ':'); colon >= 0 {
		if slash := strings.IndexByte(name, '/'); slash < 0 || colon < slash {
			return "QEMU would read the backing file name as a protocol, not a file; " + fix
		}
	}
	return ""
}

// CheckBacking checks that the overlay's backing file exists where QEMU will
// look for it: relative to the directory of overlayPath as given (QEMU does
// not resolve a symlinked overlay first). A missing base is INVALID_INPUT,
// since restoring without it would give a VM a disk QEMU cannot open.
func CheckBacking(overlayPath string, h Header) error {
	if h.BackingFile == "" {
		return nil
	}
	if p := backingNameProblem(h.BackingFile); p != "" {
		return errcode.New(errcode.InvalidInput, "overlay %s: %s", overlayPath, p)
	}
	path := filepath.Join(filepath.Dir(overlayPath), h.BackingFile)
	fi, err := os.Stat(path)
	switch {
	case errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOTDIR):
		return errcode.New(errcode.InvalidInput,
			"overlay %s needs its backing file %s at %s, which does not exist: put the base image there before restoring",
			overlayPath, h.BackingFile, path)
	case err != nil:
		return errcode.Wrap(errcode.Internal, err, "checking the backing file of overlay %s", overlayPath)
	case fi.IsDir():
		return errcode.New(errcode.InvalidInput,
			"overlay %s needs its backing file %s at %s, which is a directory: put the base image there before restoring",
			overlayPath, h.BackingFile, path)
	}
	return nil
}
