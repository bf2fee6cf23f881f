package qmptest

import (
	"bytes"
	"encoding/binary"
	"os"
)

// The framing of QEMU's migration stream that vmsnap reads (QEMU's
// migration/savevm.c and ram.c), for the fake and for tests that build
// streams.
const (
	streamMagic         = 0x5145564d // "QEVM"
	streamVersion       = 3
	SectionStart        = 0x01
	SectionPart         = 0x02
	SectionEnd          = 0x03
	SectionFull         = 0x04
	streamSubsection    = 0x05
	streamConfiguration = 0x07
	StreamCommand       = 0x08
	StreamEOF           = 0x10
	sectionFooter       = 0x7e

	ramZero    = 0x02
	ramMemSize = 0x04
	ramPage    = 0x08
	RAMEndMark = 0x10
	ramCont    = 0x20

	ramSection = 2 // the RAM section's id
	pageSize   = 4096
)

// Stream builds a migration stream framed as QEMU 7.2 frames it: a
// whole-VM precopy (IgnoreShared false), or a migration with x-ignore-shared
// (the capability listed in the configuration, each block's address in the
// RAM setup). Write the parts in stream order.
type Stream struct {
	B            bytes.Buffer
	IgnoreShared bool
	Last         string // the block of the last page record
}

// StreamBlock is a RAMBlock of a stream's RAM setup.
type StreamBlock struct {
	Name        string
	Bytes, Addr uint64
}

func (q *Stream) U8(v byte)    { q.B.WriteByte(v) }
func (q *Stream) U32(v uint32) { q.B.Write(binary.BigEndian.AppendUint32(nil, v)) }
func (q *Stream) U64(v uint64) { q.B.Write(binary.BigEndian.AppendUint64(nil, v)) }
func (q *Stream) Str(s string) { q.U8(byte(len(s))); q.B.WriteString(s) }

// Header writes the file header and the configuration section.
func (q *Stream) Header(machine string) {
	q.U32(streamMagic)
	q.U32(streamVersion)
	q.U8(streamConfiguration)
	q.U32(uint32(len(machine)))
	q.B.WriteString(machine)
	if q.IgnoreShared {
		q.U8(streamSubsection)
		q.Str("configuration/capabilities")
		q.U32(1) // version
		q.U32(1) // count
		q.Str("x-ignore-shared")
	}
}

// Start writes the RAM section's setup, with its end mark and footer.
func (q *Stream) Start(blocks []StreamBlock) {
	q.U8(SectionStart)
	q.U32(ramSection)
	q.Str("ram")
	q.U32(0) // instance
	q.U32(4) // version
	var total uint64
	for _, b := range blocks {
		total += b.Bytes
	}
	q.U64(total | ramMemSize)
	for _, b := range blocks {
		q.Str(b.Name)
		q.U64(b.Bytes)
		if q.IgnoreShared {
			q.U64(b.Addr)
		}
	}
	q.EndMark()
}

// Section starts a part (SectionPart) or the end (SectionEnd) of RAM.
func (q *Stream) Section(t byte) { q.U8(t); q.U32(ramSection) }

// EndMark ends a RAM section's records, with the section's footer.
func (q *Stream) EndMark() { q.U64(RAMEndMark); q.U8(sectionFooter); q.U32(ramSection) }

// Page writes a page record (data nil: a page of zeros), naming the block
// unless the last record was of the same block.
func (q *Stream) Page(block string, off uint64, data []byte) {
	q.Record(block, off, data, block != q.Last)
}

// Record writes a page record, naming its block or not.
func (q *Stream) Record(block string, off uint64, data []byte, named bool) {
	flags := uint64(ramPage)
	if data == nil {
		flags = ramZero
	}
	if named {
		q.U64(off | flags)
		q.Str(block)
	} else {
		q.U64(off | flags | ramCont)
	}
	q.Last = block
	if data == nil {
		q.U8(0)
	} else {
		q.B.Write(data)
	}
}

// RAMStream frames devices (the fake's State) as QEMU frames a migration
// of a VM whose RAM is backend b: the RAM file's pages (read from its
// mem-path) in one part unless x-ignore-shared leaves them out, then the
// devices.
func RAMStream(b *FakeBackend, size int64, ignoreShared bool, devices []byte) []byte {
	q := &Stream{IgnoreShared: ignoreShared}
	q.Header("pc-i440fx-7.2")
	q.Start([]StreamBlock{{Name: b.ID, Bytes: uint64(size)}})
	q.Section(SectionPart)
	if !ignoreShared {
		path := b.MemPath
		if b.HostPath != "" {
			path = b.HostPath
		}
		f, _ := os.Open(path)
		page := make([]byte, pageSize)
		for off := int64(0); off < size; off += pageSize {
			clear(page)
			if f != nil {
				_, _ = f.ReadAt(page, off)
			}
			if bytes.Count(page, []byte{0}) == pageSize {
				q.Page(b.ID, uint64(off), nil)
			} else {
				q.Page(b.ID, uint64(off), page)
			}
		}
		if f != nil {
			f.Close()
		}
	}
	q.EndMark()
	q.Section(SectionEnd)
	q.EndMark()
	q.B.Write(devices)
	return q.B.Bytes()
}
