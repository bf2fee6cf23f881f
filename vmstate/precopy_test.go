package vmstate

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"maps"
	"math/rand/v2"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// Streams are built with qmptest.Stream, framed as QEMU 7.2 frames them:
// a whole-VM pre-copy (x-ignore-shared off) and the device state of an
// x-ignore-shared migration.
type qemuStream = qmptest.Stream

// devices writes a device section and the end, as opaque to the parser as
// QEMU's are.
func devices(q *qemuStream) {
	q.U8(qemuVMSectionFull)
	q.U32(3)
	q.Str("timer")
	q.U32(0)
	q.U32(2)
	q.B.Write([]byte{1, 2, 3, 4, 5, 6, 7, 8})
	q.U8(qemuVMSectionFooter)
	q.U32(3)
	q.U8(qemuVMEOF)
}

// sink records the last copy of each page it is given.
type sink map[int][]byte

func (s sink) Page(i int, p []byte) error { s[i] = bytes.Clone(p); return nil }
func (s sink) Zero(i int) error           { s[i] = nil; return nil }

const (
	testRAMPages  = 64
	testVRAMPages = 4
	testRAMAddr   = 0x100000000
)

var testBlocks = []qmptest.StreamBlock{{Name: "ram0", Bytes: testRAMPages * ramfile.PageSize, Addr: testRAMAddr}, {Name: "vga.vram", Bytes: testVRAMPages * ramfile.PageSize}}

// precopyPair is a pre-copy stream of three passes, the x-ignore-shared
// stream it must be rewritten into, and the RAM file's final pages.
func precopyPair(seed uint64) (precopy, want []byte, final sink) {
	rng := rand.New(rand.NewPCG(seed, seed))
	pre, ign := &qemuStream{}, &qemuStream{IgnoreShared: true}
	final = sink{}
	randPage := func() []byte {
		if rng.IntN(3) == 0 {
			return nil
		}
		p := make([]byte, ramfile.PageSize)
		for k := range p {
			p[k] = byte(rng.Uint32())
		}
		return p
	}
	for _, q := range []*qemuStream{pre, ign} {
		q.Header("pc-i440fx-7.2")
		q.Start(testBlocks)
	}
	for pass := range 3 {
		t := byte(qemuVMSectionPart)
		if pass == 2 {
			t = qemuVMSectionEnd
			if seed%2 == 1 { // QEMU 10 announces the switchover
				for _, q := range []*qemuStream{pre, ign} {
					q.U8(qemuVMCommand)
					q.U32(migCmdSwitchoverStart << 16)
				}
			}
		}
		pre.Section(t)
		ign.Section(t)
		for i := range testRAMPages {
			if pass > 0 && rng.IntN(4) != 0 {
				continue
			}
			p := randPage()
			pre.Page("ram0", uint64(i)*ramfile.PageSize, p)
			final[i] = p
			if i%16 == 0 { // another block's page in between
				v := randPage()
				named := pre.Last != "vga.vram"
				pre.Page("vga.vram", uint64(i/16)*ramfile.PageSize, v)
				ign.Record("vga.vram", uint64(i/16)*ramfile.PageSize, v, named)
			}
		}
		pre.EndMark()
		ign.EndMark()
	}
	devices(pre)
	devices(ign)
	return pre.B.Bytes(), ign.B.Bytes(), final
}

func rewrite(stream []byte) ([]byte, sink, error) { return rewritePages(stream, testRAMPages) }

func rewritePages(stream []byte, pages int) ([]byte, sink, error) {
	var out bytes.Buffer
	w := bufio.NewWriter(&out)
	got := sink{}
	br := bufio.NewReader(bytes.NewReader(stream))
	err := readPrecopy(br, w, "ram0", int64(pages)*ramfile.PageSize, testRAMAddr, got)
	if err == nil {
		_, err = w.ReadFrom(br)
	}
	w.Flush()
	return out.Bytes(), got, err
}

// TestPrecopyRewritesTheStreamForIgnoreShared: the RAM file's pages go to
// the sink (the last copy of each), and what is written out is, byte for
// byte, the stream an x-ignore-shared migration of the same VM carries:
// the capability listed, each block's address in the setup, the other
// blocks' pages and the devices as they were.
func TestPrecopyRewritesTheStreamForIgnoreShared(t *testing.T) {
	for seed := range uint64(8) {
		stream, want, final := precopyPair(seed)
		out, got, err := rewrite(stream)
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if !bytes.Equal(out, want) {
			t.Fatalf("seed %d: the rewritten stream (%d bytes) is not the x-ignore-shared one (%d bytes)", seed, len(out), len(want))
		}
		if !maps.EqualFunc(got, final, bytes.Equal) {
			t.Fatalf("seed %d: the sink holds %d pages, not the last copy of each of the %d sent", seed, len(got), len(final))
		}
	}
}

// TestPrecopyRefusesWhatItDoesNotKnow: a hostile or unexpected stream is
// refused with QMP_ERROR (the checkpoint then scans the file), never read
// past its bounds nor taken for pages.
func TestPrecopyRefusesWhatItDoesNotKnow(t *testing.T) {
	good, _, _ := precopyPair(1)
	// Offsets into good: the configuration, the setup, the first record.
	cfg := 8
	setup := bytes.Index(good, []byte("\x03ram"))
	ramSetupEnd := bytes.Index(good[setup:], []byte{0, 0, 0, 0, 0, 0, 0, ramFlagEOS}) + setup
	firstRecord := ramSetupEnd + 8 + 5 + 5 // the setup's end mark, its footer, the next part's header
	with := func(at int, b ...byte) []byte {
		s := bytes.Clone(good)
		return append(s[:at], append(b, s[at:]...)...)
	}
	set := func(at int, b ...byte) []byte {
		s := bytes.Clone(good)
		copy(s[at:], b)
		return s
	}
	be64 := func(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }
	cases := map[string][]byte{
		"bad magic":                     set(0, 'X'),
		"version 2":                     set(7, 2),
		"unknown section type":          set(cfg, 0x42),
		"a huge machine type name":      set(cfg+1, 0x7f, 0xff, 0xff, 0xff),
		"unknown configuration part":    with(cfg+1+4+len("pc-i440fx-7.2"), append([]byte{qemuVMSubsection, 3, 'a', 'b', 'c'}, 0, 0, 0, 1)...),
		"another capability on":         with(cfg+1+4+len("pc-i440fx-7.2"), append(append([]byte{qemuVMSubsection, 26}, "configuration/capabilities"...), 0, 0, 0, 1, 0, 0, 0, 1, 5, 'x', 'b', 'z', 'r', 'l')...),
		"a section other than RAM":      set(setup+1, 'b', 'm'),
		"setup flags":                   set(setup+4+8+7, 0x08),
		"no such block in the setup":    set(setup+4+8+8+1, 'X'),
		"a block longer than the total": set(setup+4+8+8+1+4, 0xff),
		"page past its block":           set(firstRecord, be64(uint64(testRAMPages)*ramfile.PageSize|ramFlagPage)...),
		"page of an unknown block":      set(firstRecord+9, 'X'),
		"an XBZRLE page":                set(firstRecord+7, 0x40),
		"a compressed page":             set(firstRecord+6, 0x01),
		"a continuation with no block":  set(firstRecord+7, ramFlagPage|ramFlagContinue),
		"a footer naming another":       set(ramSetupEnd+8+4, 9),
		"devices before RAM's end":      with(ramSetupEnd+8+5, qemuVMSectionFull),
		"end of file before RAM's end":  with(ramSetupEnd+8+5, qemuVMEOF),
		"a postcopy command":            with(ramSetupEnd+8+5, qemuVMCommand, 0, 3, 0, 0),
		"switchover with a payload":     with(ramSetupEnd+8+5, qemuVMCommand, 0, migCmdSwitchoverStart, 0, 1, 0),
	}
	for name, stream := range cases {
		_, _, err := rewrite(stream)
		t.Logf("%s: %v", name, err)
		if errcode.Of(err) != errcode.QMPError {
			t.Errorf("%s: %v, want QMP_ERROR", name, err)
		}
	}
	// Cut anywhere before RAM's end: refused, never a short capture.
	end := bytes.LastIndex(good, []byte{qemuVMSectionEnd, 0, 0, 0, 2})
	for n := 0; n < end+5; n += 1 + n/64 {
		if _, _, err := rewrite(good[:n]); errcode.Of(err) != errcode.QMPError {
			t.Fatalf("a stream cut at %d of %d bytes: %v, want QMP_ERROR", n, len(good), err)
		}
	}
}

// fuzzPages is the RAM file of FuzzReadPrecopy's streams: small, so that
// its seeds are a few hundred bytes the fuzzer can work on.
const fuzzPages = 4

func FuzzReadPrecopy(f *testing.F) {
	// Seeds: zero pages and one data page of each block, in each framing
	// the parser takes.
	for _, cmd := range []bool{false, true} {
		q := &qemuStream{}
		q.Header("pc-i440fx-7.2")
		q.Start([]qmptest.StreamBlock{{Name: "ram0", Bytes: fuzzPages * ramfile.PageSize}, {Name: "rom", Bytes: ramfile.PageSize}})
		q.Section(qemuVMSectionPart)
		for i := range fuzzPages {
			q.Page("ram0", uint64(i)*ramfile.PageSize, nil)
		}
		q.Page("rom", 0, nil)
		q.EndMark()
		if cmd {
			q.U8(qemuVMCommand)
			q.U32(migCmdSwitchoverStart << 16)
		}
		q.Section(qemuVMSectionEnd)
		q.Page("ram0", 0, bytes.Repeat([]byte{7}, ramfile.PageSize))
		q.EndMark()
		devices(q)
		f.Add(q.B.Bytes())
	}
	f.Fuzz(func(t *testing.T, stream []byte) {
		out, got, err := rewritePages(stream, fuzzPages)
		if err != nil && errcode.Of(err) != errcode.QMPError {
			t.Fatalf("an error without QMP_ERROR: %v", err)
		}
		for i, p := range got {
			if i < 0 || i >= fuzzPages || (p != nil && len(p) != ramfile.PageSize) {
				t.Fatalf("page %d (%d bytes) handed over", i, len(p))
			}
		}
		// What is written out comes from what was read, plus the few bytes
		// the rewrite adds (the capability, an address per block).
		if len(out) > len(stream)+64+8*maxRAMBlocks {
			t.Fatalf("%d bytes written out of %d read", len(out), len(stream))
		}
	})
}
