package disk

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// needQemuImg skips a test that needs real images when qemu-img is missing,
// saying so, so that a green run without it is not mistaken for coverage.
func needQemuImg(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img not installed: real-image tests need it (apt-get install qemu-utils): ", err)
	}
}

// run runs a command in dir and fails the test with its output on error.
func run(t testing.TB, dir string, name string, args ...string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

func qemuImg(t testing.TB, dir string, args ...string) {
	t.Helper()
	run(t, dir, "qemu-img", args...)
}

func readFileHeader(t testing.TB, path string) (Header, error) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	return ReadHeader(f, fi.Size())
}

func mustReadHeader(t testing.TB, path string) Header {
	t.Helper()
	h, err := readFileHeader(t, path)
	if err != nil {
		t.Fatalf("ReadHeader(%s): %v", filepath.Base(path), err)
	}
	return h
}

func wantCode(t testing.TB, err error, want errcode.Code) {
	t.Helper()
	if got := errcode.Of(err); got != want {
		t.Fatalf("error code = %q, want %q (error: %v)", got, want, err)
	}
}

func TestReadHeaderRealImages(t *testing.T) {
	needQemuImg(t)
	dir := t.TempDir()
	const gib = 1 << 30
	qemuImg(t, dir, "create", "-q", "-f", "raw", "base.raw", "1M")
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "base.qcow2", "1G")
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "overlay.qcow2")
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", "overlay-raw.qcow2")
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "-o", "compat=0.10", "-b", "base.qcow2", "-F", "qcow2", "v2.qcow2")
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "-b", filepath.Join(dir, "base.qcow2"), "-F", "qcow2", "abs.qcow2")
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "-o", "data_file=data.raw", "extdata.qcow2", "1M")
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "-o", "data_file=rawdata.raw,data_file_raw=on", "extraw.qcow2", "1M")
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "-o", "cluster_size=512", "c512.qcow2", "3M")
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "-o", "cluster_size=2M,extended_l2=on", "c2m.qcow2", "3G")
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "-o", "compression_type=zstd,lazy_refcounts=on,refcount_bits=64", "zstd.qcow2", "1M")
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "snap.qcow2", "1M")
	qemuImg(t, dir, "snapshot", "-c", "s1", "snap.qcow2")
	qemuImg(t, dir, "bitmap", "--add", "snap.qcow2", "b0")

	t.Run("raw is not qcow2", func(t *testing.T) {
		_, err := readFileHeader(t, filepath.Join(dir, "base.raw"))
		wantCode(t, err, errcode.InvalidInput)
		if !strings.Contains(err.Error(), "not a qcow2 image") {
			t.Errorf("message %q does not say the file is not qcow2", err)
		}
	})

	t.Run("base", func(t *testing.T) {
		h := mustReadHeader(t, filepath.Join(dir, "base.qcow2"))
		if h.Version != 3 || h.ClusterBits != 16 || h.VirtualSize != gib || h.HeaderLength < 104 || h.RefcountOrder != 4 {
			t.Errorf("base header = %+v", h)
		}
		if h.BackingFile != "" || h.BackingFormat != "" || h.Dirty || h.Corrupt || h.ExternalData || h.Encrypted() {
			t.Errorf("base header has unexpected backing or flags: %+v", h)
		}
		// QEMU 7.2 writes its feature name table into every v3 image.
		if len(h.FeatureNames) == 0 || h.FeatureNames[0].Name != "dirty bit" {
			t.Errorf("feature names = %+v", h.FeatureNames)
		}
		if err := h.Validate(); err != nil {
			t.Errorf("Validate(base) = %v", err)
		}
	})

	t.Run("overlay", func(t *testing.T) {
		path := filepath.Join(dir, "overlay.qcow2")
		h := mustReadHeader(t, path)
		if h.BackingFile != "base.qcow2" || h.BackingFormat != "qcow2" || h.VirtualSize != gib || h.Version != 3 {
			t.Errorf("overlay header = %+v", h)
		}
		if err := h.Validate(); err != nil {
			t.Errorf("Validate(overlay) = %v", err)
		}
		if err := CheckBacking(path, h); err != nil {
			t.Errorf("CheckBacking(overlay) = %v", err)
		}
	})

	t.Run("overlay on raw", func(t *testing.T) {
		h := mustReadHeader(t, filepath.Join(dir, "overlay-raw.qcow2"))
		if h.BackingFile != "base.raw" || h.BackingFormat != "raw" || h.VirtualSize != 1<<20 {
			t.Errorf("overlay-raw header = %+v", h)
		}
		if err := h.Validate(); err != nil {
			t.Errorf("Validate(overlay-raw) = %v", err)
		}
	})

	t.Run("v2", func(t *testing.T) {
		h := mustReadHeader(t, filepath.Join(dir, "v2.qcow2"))
		if h.Version != 2 || h.HeaderLength != 72 || h.RefcountOrder != 4 || h.IncompatibleFeatures != 0 {
			t.Errorf("v2 header = %+v", h)
		}
		if h.BackingFile != "base.qcow2" || h.BackingFormat != "qcow2" || h.VirtualSize != gib {
			t.Errorf("v2 backing = %q/%q size %d", h.BackingFile, h.BackingFormat, h.VirtualSize)
		}
		if err := h.Validate(); err != nil {
			t.Errorf("Validate(v2) = %v", err)
		}
	})

	t.Run("absolute backing", func(t *testing.T) {
		h := mustReadHeader(t, filepath.Join(dir, "abs.qcow2"))
		if h.BackingFile != filepath.Join(dir, "base.qcow2") {
			t.Errorf("backing file = %q", h.BackingFile)
		}
		err := h.Validate()
		wantCode(t, err, errcode.InvalidInput)
		if !strings.Contains(err.Error(), "qemu-img rebase -u -b RELATIVE -F FMT OVERLAY") {
			t.Errorf("message %q does not say how to rebase", err)
		}
	})

	t.Run("external data file", func(t *testing.T) {
		h := mustReadHeader(t, filepath.Join(dir, "extdata.qcow2"))
		if !h.ExternalData || h.ExternalDataFile != "data.raw" || h.IncompatibleFeatures&IncompatExternalData == 0 {
			t.Errorf("extdata header = %+v", h)
		}
		wantCode(t, h.Validate(), errcode.InvalidInput)

		h = mustReadHeader(t, filepath.Join(dir, "extraw.qcow2"))
		if !h.ExternalData || h.AutoclearFeatures&AutoclearRawExternalData == 0 {
			t.Errorf("extraw header = %+v", h)
		}
		wantCode(t, h.Validate(), errcode.InvalidInput)
	})

	t.Run("cluster sizes and features", func(t *testing.T) {
		h := mustReadHeader(t, filepath.Join(dir, "c512.qcow2"))
		if h.ClusterBits != 9 || h.ClusterSize() != 512 || h.VirtualSize != 3<<20 {
			t.Errorf("c512 header = %+v", h)
		}
		h = mustReadHeader(t, filepath.Join(dir, "c2m.qcow2"))
		if h.ClusterBits != 21 || !h.ExtendedL2 || h.VirtualSize != 3*gib {
			t.Errorf("c2m header = %+v", h)
		}
		h = mustReadHeader(t, filepath.Join(dir, "zstd.qcow2"))
		if h.CompressionType != CompressionZstd || h.IncompatibleFeatures&IncompatCompressionType == 0 ||
			h.CompatibleFeatures&CompatLazyRefcounts == 0 || h.RefcountOrder != 6 {
			t.Errorf("zstd header = %+v", h)
		}
		if err := h.Validate(); err != nil {
			t.Errorf("Validate(zstd) = %v", err)
		}
	})

	t.Run("snapshots and bitmaps", func(t *testing.T) {
		h := mustReadHeader(t, filepath.Join(dir, "snap.qcow2"))
		if h.NbSnapshots != 1 || !h.HasBitmaps || h.NbBitmaps != 1 || h.AutoclearFeatures&AutoclearBitmaps == 0 {
			t.Errorf("snap header = %+v", h)
		}
		if err := h.Validate(); err != nil {
			t.Errorf("Validate(snap) = %v", err)
		}
	})
}

// TestReadHeaderRealLUKS runs in parallel with the other tests because
// qemu-img spends seconds benchmarking PBKDF for any LUKS image (a lower
// encrypt.iter-time fails intermittently with "Unable to get accurate CPU
// usage").
func TestReadHeaderRealLUKS(t *testing.T) {
	needQemuImg(t)
	t.Parallel()
	dir := t.TempDir()
	// The PBKDF benchmark reads per-thread CPU time, which some VMs and
	// sandboxes account too coarsely; qemu-img then gives up at random.
	for range 3 {
		cmd := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "--object", "secret,id=sec0,data=abc",
			"-o", "encrypt.format=luks,encrypt.key-secret=sec0", "luks.qcow2", "1M")
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err == nil {
			break
		}
		if !bytes.Contains(out, []byte("Unable to get accurate CPU usage")) {
			t.Fatalf("qemu-img create luks: %v\n%s", err, out)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "luks.qcow2")); err != nil {
		t.Skip("qemu-img cannot benchmark PBKDF on this machine (\"Unable to get accurate CPU usage\" three times); the crafted LUKS cases still run")
	}
	h := mustReadHeader(t, filepath.Join(dir, "luks.qcow2"))
	if h.CryptMethod != CryptLUKS || !h.EncryptionHeader || !h.Encrypted() || h.VirtualSize != 1<<20 {
		t.Errorf("luks header = %+v", h)
	}
	err := h.Validate()
	wantCode(t, err, errcode.InvalidInput)
	if !strings.Contains(err.Error(), "encrypted") {
		t.Errorf("message %q does not mention encryption", err)
	}
}

// TestReadHeaderDirtyRealImage makes a genuinely dirty image: with lazy
// refcounts QEMU sets the dirty bit on the first write and clears it only on
// a clean close, which qemu-io's abort command skips.
func TestReadHeaderDirtyRealImage(t *testing.T) {
	needQemuImg(t)
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io not installed: ", err)
	}
	dir := t.TempDir()
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=on", "dirty.qcow2", "1M")
	// The abort is expected to kill qemu-io; ulimit keeps it from dumping core.
	cmd := exec.Command("sh", "-c", "ulimit -c 0; exec qemu-io -c 'write 0 64k' -c abort dirty.qcow2")
	cmd.Dir = dir
	_ = cmd.Run()
	h := mustReadHeader(t, filepath.Join(dir, "dirty.qcow2"))
	if !h.Dirty {
		t.Fatalf("image left open by an aborted qemu-io is not dirty: %+v", h)
	}
	err := h.Validate()
	wantCode(t, err, errcode.InvalidInput)
	if !strings.Contains(err.Error(), "qemu-img check -r all") {
		t.Errorf("message %q does not say how to repair", err)
	}
}

// image builds a qcow2 header byte by byte, so that each test can break one
// field. Its zero-value fields are filled in by newImage with a valid 1 GiB
// version 3 image with 64 KiB clusters.
type image struct {
	magic                     string
	version                   uint32
	backingOffset             uint64 // 0 with a backing name: placed after the extensions
	backingSize               *uint32
	clusterBits               uint32
	size                      uint64
	crypt                     uint32
	l1Size                    uint32
	l1Offset, refcountOffset  uint64
	refcountClusters, nbSnap  uint32
	snapOffset                uint64
	incompat, compat, autoclr uint64
	refcountOrder, headerLen  uint32
	compression               uint8
	exts                      []ext
	noEndMarker               bool
	backing                   string
	fileSize                  int // length of the returned bytes
}

type ext struct {
	typ    uint32
	data   []byte
	length *uint32 // overrides the length field
}

func newImage() image {
	return image{
		magic: "QFI\xfb", version: 3, clusterBits: 16, size: 1 << 30,
		l1Size: 2, l1Offset: 3 << 16, refcountOffset: 1 << 16, refcountClusters: 1,
		refcountOrder: 4, headerLen: 112, fileSize: 1 << 16,
	}
}

func u32(v uint32) *uint32 { return &v }

func (m image) bytes() []byte {
	be := binary.BigEndian
	b := make([]byte, max(m.fileSize, 4096))
	copy(b, m.magic)
	be.PutUint32(b[4:], m.version)
	be.PutUint32(b[20:], m.clusterBits)
	be.PutUint64(b[24:], m.size)
	be.PutUint32(b[32:], m.crypt)
	be.PutUint32(b[36:], m.l1Size)
	be.PutUint64(b[40:], m.l1Offset)
	be.PutUint64(b[48:], m.refcountOffset)
	be.PutUint32(b[56:], m.refcountClusters)
	be.PutUint32(b[60:], m.nbSnap)
	be.PutUint64(b[64:], m.snapOffset)
	off := 72
	if m.version != 2 {
		be.PutUint64(b[72:], m.incompat)
		be.PutUint64(b[80:], m.compat)
		be.PutUint64(b[88:], m.autoclr)
		be.PutUint32(b[96:], m.refcountOrder)
		be.PutUint32(b[100:], m.headerLen)
		b[104] = m.compression
		off = int(m.headerLen)
	}
	for _, e := range m.exts {
		n := uint32(len(e.data))
		if e.length != nil {
			n = *e.length
		}
		be.PutUint32(b[off:], e.typ)
		be.PutUint32(b[off+4:], n)
		copy(b[off+8:], e.data)
		off += 8 + (len(e.data)+7)&^7
	}
	if !m.noEndMarker {
		off += 8 // zeros: the end marker
	}
	if m.backing != "" || m.backingOffset != 0 {
		bo := uint64(off)
		if m.backingOffset != 0 {
			bo = m.backingOffset
		}
		bs := uint32(len(m.backing))
		if m.backingSize != nil {
			bs = *m.backingSize
		}
		be.PutUint64(b[8:], bo)
		be.PutUint32(b[16:], bs)
		if bo < uint64(len(b)) {
			copy(b[bo:], m.backing)
		}
	}
	return b[:m.fileSize]
}

func parse(b []byte) (Header, error) { return ReadHeader(bytes.NewReader(b), int64(len(b))) }

func TestReadHeaderCrafted(t *testing.T) {
	backingFmt := func(f string) ext { return ext{typ: extBackingFmt, data: []byte(f)} }
	featureTable := func(typ, bit uint8, name string) []byte {
		e := make([]byte, featureEntrySize)
		e[0], e[1] = typ, bit
		copy(e[2:], name)
		return e
	}

	t.Run("valid", func(t *testing.T) {
		m := newImage()
		m.backing = "base.qcow2"
		m.exts = []ext{backingFmt("qcow2"), {typ: 0x12345678, data: []byte("skip me")}}
		h, err := parse(m.bytes())
		if err != nil {
			t.Fatal(err)
		}
		if h.BackingFile != "base.qcow2" || h.BackingFormat != "qcow2" || h.VirtualSize != 1<<30 || h.HeaderLength != 112 {
			t.Errorf("header = %+v", h)
		}
		if err := h.Validate(); err != nil {
			t.Errorf("Validate = %v", err)
		}
	})

	// old images put the backing name straight after the v2 header with no
	// extension area at all, so there is no end marker to find.
	t.Run("v2 without extension area", func(t *testing.T) {
		m := newImage()
		m.version = 2
		m.noEndMarker = true
		m.backing = "base.raw"
		h, err := parse(m.bytes())
		if err != nil {
			t.Fatal(err)
		}
		if h.BackingFileOffset != 72 || h.BackingFile != "base.raw" || h.BackingFormat != "" {
			t.Errorf("header = %+v", h)
		}
		err = h.Validate()
		wantCode(t, err, errcode.InvalidInput)
		if !strings.Contains(err.Error(), "-F FMT") {
			t.Errorf("missing-format message %q does not say how to record the format", err)
		}
	})

	cases := []struct {
		name   string
		edit   func(*image)
		b      func([]byte) []byte // optional edit of the bytes
		stage  string              // "read" or "validate": where the refusal must come from
		inText string              // must appear in the message
	}{
		{name: "wrong magic", edit: func(m *image) { m.magic = "QFI\xfa" }, inText: "not a qcow2 image"},
		{name: "version 1", edit: func(m *image) { m.version = 1 }, inText: "version 1"},
		{name: "version 4", edit: func(m *image) { m.version = 4 }, inText: "version 4"},
		{name: "cluster_bits 8", edit: func(m *image) { m.clusterBits = 8 }, inText: "cluster_bits 8"},
		{name: "cluster_bits 22", edit: func(m *image) { m.clusterBits = 22 }, inText: "cluster_bits 22"},
		{name: "cluster_bits huge", edit: func(m *image) { m.clusterBits = 0xffffffff }, inText: "cluster_bits"},
		{name: "header_length 96", edit: func(m *image) { m.headerLen = 96 }, inText: "header_length 96"},
		{name: "header_length 108", edit: func(m *image) { m.headerLen = 108 }, inText: "header_length 108"},
		{name: "header_length past cluster", edit: func(m *image) { m.clusterBits = 9; m.headerLen = 520; m.l1Size = 1 << 15 }, inText: "exceeds"},
		{name: "backing offset beyond file", edit: func(m *image) { m.backingOffset = 1 << 20; m.backingSize = u32(10) }, inText: "backing file name"},
		{name: "backing name past end of short file", edit: func(m *image) {
			m.backing = "base.qcow2"
			m.fileSize = 112 + 8 + 4
		}, inText: "beyond the end"},
		{name: "backing size 5000", edit: func(m *image) { m.backing = "b"; m.backingSize = u32(5000) }, inText: "5000"},
		{name: "backing overlaps header", edit: func(m *image) { m.backingOffset = 16; m.backingSize = u32(4) }, inText: "overlaps"},
		{name: "dirty bit", edit: func(m *image) { m.incompat = IncompatDirty }, stage: "validate", inText: "not closed cleanly"},
		{name: "corrupt bit", edit: func(m *image) { m.incompat = IncompatCorrupt }, stage: "validate", inText: "corrupt"},
		{name: "external data bit", edit: func(m *image) { m.incompat = IncompatExternalData }, stage: "validate", inText: "external data"},
		{name: "aes", edit: func(m *image) { m.crypt = CryptAES }, stage: "validate", inText: "encrypted"},
		{name: "luks", edit: func(m *image) {
			m.crypt = CryptLUKS
			m.exts = []ext{{typ: extEncryption, data: make([]byte, 16)}}
		}, stage: "validate", inText: "encrypted"},
		{name: "encryption extension alone", edit: func(m *image) { m.exts = []ext{{typ: extEncryption, data: make([]byte, 16)}} },
			stage: "validate", inText: "encrypted"},
		{name: "crypt_method 3", edit: func(m *image) { m.crypt = 3 }, inText: "crypt_method 3"},
		{name: "unknown incompatible bit", edit: func(m *image) { m.incompat = 1 << 5 }, inText: "bit 5"},
		{name: "unknown incompatible bit named", edit: func(m *image) {
			m.incompat = 1 << 7
			m.exts = []ext{{typ: extFeatureNames, data: featureTable(0, 7, "teleport")}}
		}, inText: `"teleport"`},
		{name: "extension length overflowing", edit: func(m *image) {
			m.exts = []ext{{typ: extBackingFmt, data: []byte("qcow2"), length: u32(0xffffffff)}}
		}, inText: "claims"},
		{name: "unknown extension past cluster", edit: func(m *image) {
			m.exts = []ext{{typ: 0x1, length: u32(1 << 16)}}
		}, inText: "claims"},
		{name: "extension area runs into backing name", edit: func(m *image) {
			m.exts = []ext{{typ: 0x1, length: u32(64)}}
			m.backingOffset = 128
			m.backing = "b"
		}, inText: "claims"},
		{name: "extension cut off", edit: func(m *image) { m.fileSize = 116 }, inText: "cut off"},
		{name: "duplicate backing format", edit: func(m *image) { m.exts = []ext{backingFmt("qcow2"), backingFmt("raw")} }, inText: "twice"},
		{name: "backing format too long", edit: func(m *image) { m.exts = []ext{backingFmt(strings.Repeat("q", 16))} }, inText: "backing format name"},
		{name: "bad encryption extension", edit: func(m *image) { m.exts = []ext{{typ: extEncryption, data: make([]byte, 8)}} }, inText: "encryption extension"},
		{name: "compression bit without type", edit: func(m *image) { m.incompat = IncompatCompressionType }, inText: "compression"},
		{name: "compression type without bit", edit: func(m *image) { m.compression = CompressionZstd }, inText: "compression"},
		{name: "compression type 2", edit: func(m *image) { m.incompat = IncompatCompressionType; m.compression = 2 }, inText: "compression type 2"},
		{name: "virtual size 2^60", edit: func(m *image) { m.size = 1 << 60; m.l1Size = maxL1Entries }, inText: "2^56"},
		{name: "l1 too small", edit: func(m *image) { m.size = 1 << 40 }, inText: "too small"},
		{name: "l1 too large", edit: func(m *image) { m.l1Size = maxL1Entries + 1 }, inText: "l1_size"},
		{name: "refcount table unaligned", edit: func(m *image) { m.refcountOffset = 4096 }, inText: "aligned"},
		{name: "no refcount table", edit: func(m *image) { m.refcountClusters = 0 }, inText: "refcount table"},
		{name: "refcount_order 7", edit: func(m *image) { m.refcountOrder = 7 }, inText: "refcount_order 7"},
		{name: "truncated to 50 bytes", edit: func(m *image) { m.fileSize = 50 }, inText: "beyond the end"},
		{name: "truncated inside v3 header", edit: func(m *image) { m.fileSize = 100 }, inText: "beyond the end"},
		{name: "shorter than header_length", edit: func(m *image) { m.headerLen = 128; m.fileSize = 120 }, inText: "shorter"},
		{name: "truncated to 4 bytes", edit: func(m *image) { m.fileSize = 4 }, inText: "only 4 bytes"},
		{name: "empty", edit: func(m *image) { m.fileSize = 0 }, inText: "only 0 bytes"},
		{name: "absolute backing", edit: func(m *image) {
			m.backing = "/var/lib/images/base.qcow2"
			m.exts = []ext{backingFmt("qcow2")}
		}, stage: "validate", inText: "absolute"},
		{name: "escaping backing", edit: func(m *image) { m.backing = "../x"; m.exts = []ext{backingFmt("qcow2")} },
			stage: "validate", inText: "qemu-img rebase -u -b RELATIVE -F FMT OVERLAY"},
		{name: "dot-dot inside backing", edit: func(m *image) { m.backing = "sub/../base.qcow2"; m.exts = []ext{backingFmt("qcow2")} },
			stage: "validate", inText: `".."`},
		{name: "protocol backing", edit: func(m *image) { m.backing = "nbd://host/export"; m.exts = []ext{backingFmt("raw")} },
			stage: "validate", inText: "protocol"},
		{name: "missing backing format", edit: func(m *image) { m.backing = "base.qcow2" }, stage: "validate", inText: "rebase -u -b base.qcow2 -F FMT"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := newImage()
			tc.edit(&m)
			b := m.bytes()
			if tc.b != nil {
				b = tc.b(b)
			}
			h, err := parse(b)
			if tc.stage == "validate" {
				if err != nil {
					t.Fatalf("ReadHeader refused what Validate should judge: %v", err)
				}
				err = h.Validate()
			}
			wantCode(t, err, errcode.InvalidInput)
			if !strings.Contains(err.Error(), tc.inText) {
				t.Errorf("message %q does not contain %q", err, tc.inText)
			}
		})
	}
}

// TestValidateListsEveryProblem checks that one refusal names every problem,
// so that a user does not fix them one run at a time.
func TestValidateListsEveryProblem(t *testing.T) {
	h := Header{Dirty: true, CryptMethod: CryptLUKS, BackingFile: "/abs"}
	err := h.Validate()
	wantCode(t, err, errcode.InvalidInput)
	var e *errcode.Error
	if !errors.As(err, &e) || len(e.Details) != 3 {
		t.Fatalf("want 3 details, got %v", err)
	}
}

type failingReader struct{}

func (failingReader) ReadAt([]byte, int64) (int, error) { return 0, errors.New("disk on fire") }

func TestReadHeaderIOErrorIsInternal(t *testing.T) {
	_, err := ReadHeader(failingReader{}, 1<<16)
	wantCode(t, err, errcode.Internal)
	// A file that is shorter than the caller said is the file's fault.
	b := newImage().bytes()
	_, err = ReadHeader(bytes.NewReader(b[:60]), int64(len(b)))
	wantCode(t, err, errcode.InvalidInput)
	_, err = ReadHeader(bytes.NewReader(b), -1)
	wantCode(t, err, errcode.Internal)
}

func TestCheckBacking(t *testing.T) {
	dir := t.TempDir()
	sub := filepath.Join(dir, "vm")
	if err := os.MkdirAll(filepath.Join(sub, "bases"), 0o755); err != nil {
		t.Fatal(err)
	}
	overlay := filepath.Join(sub, "overlay.qcow2")
	if err := os.WriteFile(filepath.Join(sub, "bases", "base.qcow2"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}

	if err := CheckBacking(overlay, Header{}); err != nil {
		t.Errorf("no backing file: %v", err)
	}
	if err := CheckBacking(overlay, Header{BackingFile: "bases/base.qcow2", BackingFormat: "qcow2"}); err != nil {
		t.Errorf("existing backing file: %v", err)
	}

	err := CheckBacking(overlay, Header{BackingFile: "base.qcow2", BackingFormat: "qcow2"})
	wantCode(t, err, errcode.InvalidInput)
	for _, want := range []string{overlay, filepath.Join(sub, "base.qcow2"), "does not exist", "put the base image there"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("message %q does not contain %q", err, want)
		}
	}
	// A path through a regular file is as missing as a missing one.
	wantCode(t, CheckBacking(overlay, Header{BackingFile: "bases/base.qcow2/x"}), errcode.InvalidInput)
	wantCode(t, CheckBacking(overlay, Header{BackingFile: "bases"}), errcode.InvalidInput)
	// It refuses to look outside the overlay's directory at all.
	if err := os.WriteFile(filepath.Join(dir, "outside.qcow2"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	wantCode(t, CheckBacking(overlay, Header{BackingFile: "../outside.qcow2"}), errcode.InvalidInput)
}

func TestCheckBackingRealOverlay(t *testing.T) {
	needQemuImg(t)
	dir := t.TempDir()
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "base.qcow2", "1M")
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "overlay.qcow2")
	path := filepath.Join(dir, "overlay.qcow2")
	h := mustReadHeader(t, path)
	if err := CheckBacking(path, h); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, "base.qcow2")); err != nil {
		t.Fatal(err)
	}
	wantCode(t, CheckBacking(path, h), errcode.InvalidInput)
}

func FuzzReadHeader(f *testing.F) {
	// Crafted seeds work without qemu-img.
	m := newImage()
	m.backing = "base.qcow2"
	m.exts = []ext{{typ: extBackingFmt, data: []byte("qcow2")}}
	f.Add(m.bytes())
	m.version = 2
	f.Add(m.bytes())
	m = newImage()
	m.exts = []ext{{typ: extDataFile, data: []byte("d.raw")}, {typ: extBitmaps, data: make([]byte, 24)}}
	m.incompat = IncompatExternalData | IncompatDirty
	f.Add(m.bytes())
	// LUKS comes crafted: qemu-img takes seconds to make a real one.
	m = newImage()
	m.crypt = CryptLUKS
	m.exts = []ext{{typ: extEncryption, data: make([]byte, 16)}, {typ: 0x1234, data: []byte{1}}}
	f.Add(m.bytes())

	if _, err := exec.LookPath("qemu-img"); err == nil {
		dir := f.TempDir()
		qemuImg(f, dir, "create", "-q", "-f", "qcow2", "base.qcow2", "1G")
		qemuImg(f, dir, "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "ov.qcow2")
		qemuImg(f, dir, "create", "-q", "-f", "qcow2", "-o", "compat=0.10", "-b", "base.qcow2", "-F", "qcow2", "v2.qcow2")
		qemuImg(f, dir, "create", "-q", "-f", "qcow2", "-o", "data_file=d.raw", "ext.qcow2", "1M")
		qemuImg(f, dir, "create", "-q", "-f", "qcow2", "-o", "cluster_size=512,compression_type=zstd", "c512.qcow2", "1M")
		for _, name := range []string{"base.qcow2", "ov.qcow2", "v2.qcow2", "ext.qcow2", "c512.qcow2"} {
			b, err := os.ReadFile(filepath.Join(dir, name))
			if err != nil {
				f.Fatal(err)
			}
			// The header, its extensions and the backing name sit in the
			// first few hundred bytes; the rest would only slow the fuzzer.
			f.Add(b[:min(len(b), 4096)])
		}
	}

	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := parse(b)
		if err != nil {
			if c := errcode.Of(err); c != errcode.InvalidInput {
				t.Fatalf("in-memory input gave %s, not INVALID_INPUT: %v", c, err)
			}
			return
		}
		if h.Version != 2 && h.Version != 3 {
			t.Fatalf("version %d accepted", h.Version)
		}
		if h.ClusterBits < MinClusterBits || h.ClusterBits > MaxClusterBits {
			t.Fatalf("cluster_bits %d accepted", h.ClusterBits)
		}
		if h.Version == 2 && h.HeaderLength != 72 ||
			h.Version == 3 && (h.HeaderLength < 104 || h.HeaderLength%8 != 0 || uint64(h.HeaderLength) > h.ClusterSize()) ||
			int(h.HeaderLength) > len(b) {
			t.Fatalf("header_length %d accepted for version %d, file %d", h.HeaderLength, h.Version, len(b))
		}
		if h.VirtualSize > MaxVirtualSize || h.RefcountOrder > 6 || h.CryptMethod > CryptLUKS || h.CompressionType > CompressionZstd {
			t.Fatalf("out-of-range field accepted: %+v", h)
		}
		if h.IncompatibleFeatures&^knownIncompat != 0 {
			t.Fatalf("unknown incompatible bits accepted: %#x", h.IncompatibleFeatures)
		}
		bits := h.IncompatibleFeatures
		if h.Dirty != (bits&IncompatDirty != 0) || h.Corrupt != (bits&IncompatCorrupt != 0) ||
			h.ExternalData != (bits&IncompatExternalData != 0) || h.ExtendedL2 != (bits&IncompatExtendedL2 != 0) {
			t.Fatalf("flags disagree with bits %#x: %+v", bits, h)
		}
		if (bits&IncompatCompressionType != 0) != (h.CompressionType != CompressionZlib) {
			t.Fatalf("compression type %d with bits %#x", h.CompressionType, bits)
		}
		if len(h.BackingFormat) > maxFormatName || len(h.BackingFile) > MaxBackingFileName {
			t.Fatalf("over-long names accepted: %q %q", h.BackingFormat, h.BackingFile)
		}
		if h.BackingFile != "" {
			end := h.BackingFileOffset + uint64(h.BackingFileSize)
			if uint64(len(h.BackingFile)) != uint64(h.BackingFileSize) || h.BackingFileOffset < uint64(h.HeaderLength) ||
				end > uint64(len(b)) || end > h.ClusterSize() || string(b[h.BackingFileOffset:end]) != h.BackingFile {
				t.Fatalf("backing name %q does not match offset %d size %d", h.BackingFile, h.BackingFileOffset, h.BackingFileSize)
			}
		}
		// Parsing is deterministic.
		if h2, err := parse(b); err != nil || !headersEqual(h, h2) {
			t.Fatalf("second parse differs: %v", err)
		}
		// Validate judges any accepted header without panicking, and what it
		// passes is safe to restore next to its base.
		if h.Validate() == nil {
			if h.Dirty || h.Corrupt || h.Encrypted() || h.ExternalData {
				t.Fatalf("Validate passed a header it must refuse: %+v", h)
			}
			if h.BackingFile != "" && (!filepath.IsLocal(h.BackingFile) || h.BackingFormat == "") {
				t.Fatalf("Validate passed backing %q format %q", h.BackingFile, h.BackingFormat)
			}
		}
	})
}

func headersEqual(a, b Header) bool { return reflect.DeepEqual(a, b) }
