package vmstate

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// A snapshot-mode memory-file checkpoint of a running VM takes the RAM
// file's pages from a pre-copy: a live migration of the whole VM
// (x-ignore-shared off) into vmsnap, which keeps the pages of the RAM
// file's block (ramfile.Shadow) and discards the rest. QEMU's own dirty
// tracking (TCG's or KVM's, and vhost-user's dirty log) decides which pages
// it sends again, so nothing outside QEMU has to guess which pages the
// guest wrote; QEMU stops the VM for its final pass once what is left is
// small. The guest's downtime is that final pass, the device state
// (a second, x-ignore-shared migration, as a scan's checkpoint takes it)
// and the disk, not a read of the whole RAM file while the VM is stopped.
//
// The stream is parsed only as far as the RAM section's end; it is QEMU's
// and may be hostile, so every length is bounded, every page address
// checked against its block, and anything the parser does not know (an
// iterable section other than RAM, compressed or XBZRLE pages, a device
// section before RAM's end) fails the pre-copy: the checkpoint then scans
// the file with the VM stopped, as in pause mode.

// The migration stream's framing (QEMU's migration/savevm.c).
const (
	qemuVMFileMagic     = 0x5145564d // "QEVM"
	qemuVMFileVersion   = 3
	qemuVMEOF           = 0x10
	qemuVMSectionStart  = 0x01
	qemuVMSectionPart   = 0x02
	qemuVMSectionEnd    = 0x03
	qemuVMSectionFull   = 0x04
	qemuVMSubsection    = 0x05
	qemuVMConfiguration = 0x07
	qemuVMCommand       = 0x08
	qemuVMSectionFooter = 0x7e
)

// The RAM section's page-record flags (QEMU's migration/ram.c), in the low
// bits of each record's page address.
const (
	ramFlagZero         = 0x02
	ramFlagMemSize      = 0x04
	ramFlagPage         = 0x08
	ramFlagEOS          = 0x10
	ramFlagContinue     = 0x20
	ramFlagMultifdFlush = 0x200
	ramFlagMask         = ramfile.PageSize - 1

	// migCmdSwitchoverStart: QEMU 10 tells the target it is about to
	// complete (no payload), between RAM's last part and its end.
	migCmdSwitchoverStart = 11
)

// Bounds on what the stream may declare.
const (
	maxConfigName   = 256 // the machine type's name
	maxCapabilities = 64
	maxRAMBlocks    = 256
)

// pageSink takes the pages of the RAM file's block (ramfile.Shadow).
type pageSink interface {
	Page(i int, p []byte) error
	Zero(i int) error
}

// precopyStream reads a pre-copy's migration stream (x-ignore-shared off)
// and writes out what an x-ignore-shared migration of the same moment
// would have carried: the same stream without the RAM file's pages, its
// RAM setup giving each block's address and its configuration listing
// x-ignore-shared. That is the device state a memory-file image holds:
// a restore loads it into a QEMU that maps the RAM file. (QEMU refuses a
// second migration of a VM its first one stopped, so the device state
// cannot be asked for again once the pre-copy completes.)
type precopyStream struct {
	r      *bufio.Reader
	out    *bufio.Writer
	block  string // the RAM file's RAMBlock: the backend's id
	size   int64
	addr   uint64 // its memory region's address (qom "addr")
	sink   pageSink
	blocks map[string]int64 // every RAMBlock's length, from the setup
	cur    string           // the block of the last page record
	ramID  uint32
	page   [ramfile.PageSize]byte
}

func streamErr(format string, args ...any) error {
	return errcode.New(errcode.QMPError, "QEMU's pre-copy stream: "+format, args...)
}

// readPrecopy reads the stream up to and including the RAM section's end,
// handing the pages of block (size bytes at guest address addr) to sink
// and writing the rest, rewritten for x-ignore-shared, to out.
func readPrecopy(r *bufio.Reader, out *bufio.Writer, block string, size int64, addr uint64, sink pageSink) error {
	s := &precopyStream{r: r, out: out, block: block, size: size, addr: addr, sink: sink}
	magic, err := s.u32()
	if err != nil || magic != qemuVMFileMagic {
		return streamErr("not a migration stream (magic %#x)", magic)
	}
	version, err := s.u32()
	if err != nil || version != qemuVMFileVersion {
		return streamErr("version %d, not %d", version, qemuVMFileVersion)
	}
	s.put32(magic)
	s.put32(version)
	for {
		t, err := s.r.ReadByte()
		if err != nil {
			return s.eof(err)
		}
		switch t {
		case qemuVMConfiguration:
			if err := s.configuration(); err != nil {
				return err
			}
		case qemuVMSectionStart:
			if err := s.sectionStart(); err != nil {
				return err
			}
		case qemuVMSectionPart, qemuVMSectionEnd:
			id, err := s.u32()
			if err != nil {
				return s.eof(err)
			}
			if s.blocks == nil || id != s.ramID {
				return streamErr("a section (id %d) other than RAM's is iterated: only RAM is supported", id)
			}
			s.out.WriteByte(t)
			s.put32(id)
			if err := s.records(); err != nil {
				return err
			}
			if err := s.footer(id); err != nil {
				return err
			}
			if t == qemuVMSectionEnd {
				return nil
			}
		case qemuVMCommand:
			var b [4]byte
			if _, err := io.ReadFull(s.r, b[:]); err != nil {
				return s.eof(err)
			}
			cmd, n := binary.BigEndian.Uint16(b[:2]), binary.BigEndian.Uint16(b[2:])
			if cmd != migCmdSwitchoverStart || n != 0 {
				return streamErr("command %d (%d bytes): only switchover-start is supported", cmd, n)
			}
			s.out.WriteByte(t)
			s.out.Write(b[:])
		case qemuVMSectionFull:
			return streamErr("device state before RAM's end (an early-setup device?): not supported")
		case qemuVMEOF:
			return streamErr("ended before its RAM section did")
		default:
			return streamErr("unknown section type %#x", t)
		}
	}
}

func (s *precopyStream) eof(err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return streamErr("cut short")
	}
	return errcode.Wrap(errcode.QMPError, err, "reading QEMU's pre-copy stream")
}

func (s *precopyStream) u32() (uint32, error) {
	var b [4]byte
	if _, err := io.ReadFull(s.r, b[:]); err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint32(b[:]), nil
}

func (s *precopyStream) u64() (uint64, error) {
	var b [8]byte
	if _, err := io.ReadFull(s.r, b[:]); err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint64(b[:]), nil
}

// str reads a string with a one-byte length.
func (s *precopyStream) str() (string, error) {
	n, err := s.r.ReadByte()
	if err != nil {
		return "", err
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(s.r, b); err != nil {
		return "", err
	}
	return string(b), nil
}

// Writes go to a bufio.Writer, whose error sticks: Flush reports it.
func (s *precopyStream) put32(v uint32) { s.out.Write(binary.BigEndian.AppendUint32(nil, v)) }
func (s *precopyStream) put64(v uint64) { s.out.Write(binary.BigEndian.AppendUint64(nil, v)) }
func (s *precopyStream) putStr(v string) {
	s.out.WriteByte(byte(len(v)))
	s.out.WriteString(v)
}

// configuration copies the machine type and the subsections, each of a
// known layout, and lists x-ignore-shared among the capabilities (a
// target that has it on refuses a stream that does not).
func (s *precopyStream) configuration() error {
	n, err := s.u32()
	if err != nil {
		return s.eof(err)
	}
	if n > maxConfigName {
		return streamErr("a machine type name of %d bytes", n)
	}
	name := make([]byte, n)
	if _, err := io.ReadFull(s.r, name); err != nil {
		return s.eof(err)
	}
	var pageBits, uuid []byte // subsections kept, in QEMU's order around the capabilities
	for {
		b, err := s.r.Peek(1)
		if err != nil {
			return s.eof(err)
		}
		if b[0] != qemuVMSubsection {
			break
		}
		_, _ = s.r.ReadByte()
		sub, err := s.str()
		if err != nil {
			return s.eof(err)
		}
		version, err := s.u32()
		if err != nil {
			return s.eof(err)
		}
		head := append(append([]byte{qemuVMSubsection, byte(len(sub))}, sub...), binary.BigEndian.AppendUint32(nil, version)...)
		switch sub {
		case "configuration/target-page-bits":
			bits, err := s.u32()
			if err != nil {
				return s.eof(err)
			}
			if bits > 31 || 1<<bits != ramfile.PageSize {
				return streamErr("target pages of 2^%d bytes, not %d", bits, ramfile.PageSize)
			}
			pageBits = binary.BigEndian.AppendUint32(head, bits)
		case "configuration/capabilities":
			count, err := s.u32()
			if err != nil {
				return s.eof(err)
			}
			if count > maxCapabilities {
				return streamErr("%d capabilities", count)
			}
			for range count {
				c, err := s.str()
				if err != nil {
					return s.eof(err)
				}
				if c != capIgnoreShared {
					return streamErr("capability %q is on", c)
				}
			}
		case "configuration/uuid":
			u := make([]byte, 16)
			if _, err := io.ReadFull(s.r, u); err != nil {
				return s.eof(err)
			}
			uuid = append(head, u...)
		default:
			return streamErr("unknown configuration subsection %q", sub)
		}
	}
	s.out.WriteByte(qemuVMConfiguration)
	s.put32(n)
	s.out.Write(name)
	s.out.Write(pageBits)
	s.out.WriteByte(qemuVMSubsection)
	s.putStr("configuration/capabilities")
	s.put32(1) // version
	s.put32(1) // count
	s.putStr(capIgnoreShared)
	s.out.Write(uuid)
	return nil
}

// sectionStart reads RAM's setup, its total size and every block's
// length, and writes it with each block's address, as x-ignore-shared
// does: the RAM file's from QEMU, 0 for the others (a target checks only
// the address of the blocks it ignores).
func (s *precopyStream) sectionStart() error {
	id, err := s.u32()
	if err != nil {
		return s.eof(err)
	}
	name, err := s.str()
	if err != nil {
		return s.eof(err)
	}
	instance, err := s.u32()
	if err != nil {
		return s.eof(err)
	}
	version, err := s.u32()
	if err != nil {
		return s.eof(err)
	}
	if name != "ram" {
		return streamErr("iterable section %q: only RAM is supported", name)
	}
	if s.blocks != nil {
		return streamErr("a second RAM section")
	}
	s.out.WriteByte(qemuVMSectionStart)
	s.put32(id)
	s.putStr(name)
	s.put32(instance)
	s.put32(version)
	v, err := s.u64()
	if err != nil {
		return s.eof(err)
	}
	if v&ramFlagMask != ramFlagMemSize {
		return streamErr("RAM setup flags %#x", v&ramFlagMask)
	}
	s.put64(v)
	total := v &^ ramFlagMask
	s.ramID, s.blocks = id, map[string]int64{}
	for left := total; left > 0; {
		if len(s.blocks) == maxRAMBlocks {
			return streamErr("more than %d RAM blocks", maxRAMBlocks)
		}
		name, err := s.str()
		if err != nil {
			return s.eof(err)
		}
		length, err := s.u64()
		if err != nil {
			return s.eof(err)
		}
		if length > left || length%ramfile.PageSize != 0 {
			return streamErr("RAM block %q of %d bytes in %d left", name, length, left)
		}
		if _, dup := s.blocks[name]; dup {
			return streamErr("RAM block %q twice", name)
		}
		s.blocks[name] = int64(length)
		left -= length
		s.putStr(name)
		s.put64(length)
		if name == s.block {
			s.put64(s.addr)
		} else {
			s.put64(0)
		}
	}
	if got, ok := s.blocks[s.block]; !ok || got != s.size {
		return streamErr("no RAM block %q of %d bytes (the memory backend)", s.block, s.size)
	}
	if err := s.records(); err != nil {
		return err
	}
	return s.footer(id)
}

// records reads page records up to the next end-of-section mark, handing
// the RAM file's pages to the sink and copying the others.
func (s *precopyStream) records() error {
	for {
		v, err := s.u64()
		if err != nil {
			return s.eof(err)
		}
		flags, addr := v&ramFlagMask, v&^ramFlagMask
		switch {
		case flags == ramFlagEOS || flags == ramFlagMultifdFlush:
			s.put64(v)
			if flags == ramFlagEOS {
				return nil
			}
			continue
		case flags&^ramFlagContinue != ramFlagZero && flags&^ramFlagContinue != ramFlagPage:
			return streamErr("RAM record flags %#x (compression, XBZRLE or multifd are not supported)", flags)
		}
		// A record without a block name continues the previous record's
		// block, so dropping the RAM file's records leaves every other
		// record's block as it was.
		if flags&ramFlagContinue == 0 {
			if s.cur, err = s.str(); err != nil {
				return s.eof(err)
			}
		}
		length, ok := s.blocks[s.cur]
		if !ok {
			return streamErr("a page of unknown RAM block %q", s.cur)
		}
		if addr >= uint64(length) {
			return streamErr("page %#x past the end of RAM block %q (%d bytes)", addr, s.cur, length)
		}
		ours := s.cur == s.block
		if !ours {
			s.put64(v)
			if flags&ramFlagContinue == 0 {
				s.putStr(s.cur)
			}
		}
		i := int(addr / ramfile.PageSize)
		if flags&ramFlagZero != 0 {
			fill, err := s.r.ReadByte()
			if err != nil {
				return s.eof(err)
			}
			switch {
			case !ours:
				s.out.WriteByte(fill)
			case fill == 0:
				err = s.sink.Zero(i)
			default:
				for k := range s.page {
					s.page[k] = fill
				}
				err = s.sink.Page(i, s.page[:])
			}
			if err != nil {
				return err
			}
			continue
		}
		if _, err := io.ReadFull(s.r, s.page[:]); err != nil {
			return s.eof(err)
		}
		if !ours {
			s.out.Write(s.page[:])
			continue
		}
		if err := s.sink.Page(i, s.page[:]); err != nil {
			return err
		}
	}
}

// footer copies a section's footer, if the stream has them.
func (s *precopyStream) footer(id uint32) error {
	b, err := s.r.Peek(1)
	if err != nil || b[0] != qemuVMSectionFooter {
		return nil // no footers (or the end: the next read says so)
	}
	_, _ = s.r.ReadByte()
	got, err := s.u32()
	if err != nil {
		return s.eof(err)
	}
	if got != id {
		return streamErr("section %d's footer names section %d", id, got)
	}
	s.out.WriteByte(qemuVMSectionFooter)
	s.put32(id)
	return nil
}

// Pre-copy pacing and bounds.
const (
	// precopyDowntimeMs is the downtime limit of a pre-copy: QEMU stops
	// the VM for its final pass once it expects to send what is left in
	// less than this. Low, since the pipe into vmsnap is fast.
	precopyDowntimeMs = 20
	// precopyForceAfter: a guest that dirties memory faster than QEMU
	// sends it never gets there. After this long (plus the time to send
	// the RAM file once at 256 MiB/s), QEMU is told to stop the VM for one
	// pass of whatever is left, as a scan would; after twice that, the
	// pre-copy is given up (cancelled, the VM running) for a scan.
	precopyForceAfter = 5 * time.Second
	// maxPrecopyDevices bounds the device state the pre-copy writes out:
	// the other RAM blocks' pages (video RAM, ROMs: each page possibly
	// sent more than once) and the devices after RAM's end.
	maxPrecopyDevices = 1 << 30
)

// precopied is what a pre-copy took.
type precopied struct {
	capture   *ramfile.Capture
	devices   *os.File // the device state, for x-ignore-shared (unlinked)
	deviceLen int64
	stoppedAt time.Time // when QEMU stopped the VM for the final pass
	unsent    int       // pages QEMU never sent, read from the file once it stopped the VM
}

func (p *precopied) close() {
	if p.capture != nil {
		p.capture.Close()
	}
	if p.devices != nil {
		p.devices.Close()
	}
}

// precopy takes the RAM file's pages and the device state from a pre-copy
// migration of the running VM; it returns with the VM stopped by QEMU for
// the migration's final pass. f is the RAM file: the pages QEMU leaves out
// (a balloon's free-page hints) are read from it once the VM is stopped.
// On an error the migration is over: cancelled with the VM running, or
// completed with it stopped (QEMU then refuses another migration until it
// runs again).
func precopy(ctx context.Context, mon Monitor, g *sourceGuard, be *RAMBackend, f *os.File, parent *ramfile.Parent, stagingDir string) (_ *precopied, err error) {
	if len(be.OtherShared) > 0 {
		return nil, errcode.New(errcode.Usage, "the VM has other shared memory backends (%s), which an x-ignore-shared restore leaves out too", strings.Join(be.OtherShared, ", "))
	}
	addr, err := backendAddr(ctx, mon, be.ID)
	if err != nil {
		return nil, err
	}
	limit, err := enterPrecopySettings(ctx, mon)
	if err != nil {
		return nil, err
	}
	defer limit.restore(g, &err)
	if err := limit.set(ctx, precopyDowntimeMs); err != nil {
		return nil, errcode.Ensure(errcode.QMPError, err, "setting the downtime limit")
	}

	p := &precopied{}
	defer func() {
		if err != nil {
			p.close()
		}
	}()
	sh, err := ramfile.NewShadow(be.Bytes, parent, stagingDir)
	if err != nil {
		return nil, err
	}
	defer sh.Close()
	if p.devices, err = os.CreateTemp(stagingDir, ".vmsnap-devices-*.tmp"); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "creating the device state's staging file in %s (pick another with %s)", stagingDir, errcode.Field("stagingDir"))
	}
	os.Remove(p.devices.Name())
	pipe, err := openOutgoingPipe(ctx, mon)
	if err != nil {
		return nil, err
	}
	defer pipe.close(mon, g)

	events := mon.Subscribe()
	defer events.Close()
	sub := mon.Subscribe()
	defer sub.Close()
	parse := precopyParser(be, addr, sh, p.devices)

	g.phase = "pre-copying the RAM file's pages"
	forceAfter := precopyForceAfter + time.Duration(be.Bytes/(256<<20))*time.Second
	force := time.AfterFunc(forceAfter, func() { _ = limit.set(ctx, 2000000) })
	defer force.Stop()
	wctx, cancelWait := context.WithTimeoutCause(ctx, 2*forceAfter, errcode.New(errcode.QMPError, "QEMU did not complete the pre-copy within %v", 2*forceAfter))
	defer cancelWait()
	if _, err := pipe.migrate(wctx, mon, g, sub, parse); err != nil {
		if g.migrating {
			// Not completed: cancelled, so that a scan may follow.
			cctx, cancel := g.cleanupCtx(30 * time.Second)
			cancelMigration(cctx, mon)
			cancel()
			g.migrating = false
		}
		return nil, err
	}
	if p.stoppedAt, err = precopyStoppedAt(ctx, mon, events); err != nil {
		return nil, err
	}
	if err := p.finish(sh, f); err != nil {
		return nil, err
	}
	return p, nil
}

// precopyUntrusted says why QEMU's dirty log cannot be trusted with a
// pre-copy of this VM ("" when it can). Under TCG, QEMU before 9.0 clears
// the migration dirty bitmap a 64-page word at a time without bringing
// the vCPUs' TLBs up to date: a vCPU whose TLB entry already marked a page
// dirty keeps writing it through that entry, unseen, until the entry is
// flushed, and the final pass leaves those writes out (QEMU 9.0's
// "physmem: Fix migration dirty bitmap coherency with TCG memory access").
// A restored guest then runs on memory that is not what it left: seen
// here, rarely, as a kernel that panicked in its per-CPU timer data or
// went silent (the likely cause; no lost write was caught in the act).
// KVM's dirty log comes from the kernel's write protection and
// is exact with any QEMU. A scan of the stopped VM's file needs no log.
func precopyUntrusted(ctx context.Context, mon Executor, qemuVersion string) string {
	var kvm struct{ Enabled bool }
	if err := mon.Execute(ctx, "query-kvm", nil, &kvm); err == nil && kvm.Enabled {
		return ""
	}
	if cmpVersion(majorMinor(qemuVersion), "9.0") >= 0 {
		return ""
	}
	return fmt.Sprintf("QEMU %s under TCG loses guest writes from a pre-copy's dirty log (fixed in QEMU 9.0; KVM is not affected): scanned the RAM file with the VM stopped", qemuVersion)
}

// errNoFallback marks a pre-copy failure after which a scan must not run.
var errNoFallback = errors.New("x-ignore-shared could not be set back")

// backendAddr is the guest address of the memory backend's region, which a
// target with x-ignore-shared checks (QOM: the backend's memory-region
// child, property addr).
func backendAddr(ctx context.Context, mon Executor, id string) (uint64, error) {
	var addr uint64
	var err error
	for _, child := range []string{id + "[0]", id} {
		if err = mon.Execute(ctx, "qom-get", map[string]string{"path": "/objects/" + id + "/" + child, "property": "addr"}, &addr); err == nil {
			return addr, nil
		}
	}
	return 0, errcode.Ensure(errcode.QMPError, err, "reading the address of memory backend %s", id)
}

// limitedWriter fails writes past its bound.
type limitedWriter struct {
	w    io.Writer
	left int64
}

func (l *limitedWriter) Write(p []byte) (int, error) {
	if int64(len(p)) > l.left {
		return 0, streamErr("more device state than a VM of this size may have")
	}
	l.left -= int64(len(p))
	return l.w.Write(p)
}

// How a memory-file checkpoint read the RAM file (CheckpointResult).
const (
	CapturePrecopy = "precopy" // a pre-copy migration, the VM running but for its final pass
	CaptureScan    = "scan"    // a scan of the file, the VM stopped
)

// precopyNote says why a checkpoint scanned the RAM file instead.
func precopyNote(err error) string {
	return fmt.Sprintf("pre-copy failed, scanned with the VM stopped: %v", err)
}
