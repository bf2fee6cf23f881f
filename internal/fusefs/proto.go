package fusefs

import "encoding/binary"

// The FUSE protocol as this server speaks it (include/uapi/linux/fuse.h).
// Every struct used here has had its size since protocol 7.9 (INIT's reply
// since 7.23), so within the minors we accept only INIT's flags2 and
// max_stack_depth depend on the negotiated minor.
const (
	kernelMajor = 7
	minMinor    = 31 // the oldest minor we accept from a kernel
	ourMinor    = 40 // pinned: FUSE_NOTIFY_RESEND and FUSE_HAS_RESEND arrived in 7.40

	inHeaderSize  = 40
	outHeaderSize = 16
	attrSize      = 88
	entryOutSize  = 40 + attrSize
	attrOutSize   = 16 + attrSize
	openOutSize   = 16
	statfsOutSize = 80
	direntBase    = 24
	initOutSize   = 64

	rootNode = 1 // FUSE_ROOT_ID

	// MaxRead bounds a READ (and the readahead we accept): 1 MiB, so a
	// reply never needs more than one 1 MiB buffer and no pipe is involved.
	MaxRead  = 1 << 20
	maxPages = MaxRead / 4096
	// maxWrite is the kernel's minimum: we refuse every write, and it keeps
	// the buffer a request is read into small.
	maxWrite = 4096
	// bufSize holds any request the kernel may send with maxWrite (the
	// kernel wants at least 8 KiB); bigger ones (a huge setxattr) are failed
	// by the kernel itself.
	bufSize = 16 << 10

	// entryValid and attrValid: a file's size and attributes never change.
	entryValid = 3600
	attrValid  = 3600
)

// Opcodes.
const (
	opLookup          = 1
	opForget          = 2
	opGetattr         = 3
	opSetattr         = 4
	opSymlink         = 6
	opMknod           = 8
	opMkdir           = 9
	opUnlink          = 10
	opRmdir           = 11
	opRename          = 12
	opLink            = 13
	opOpen            = 14
	opRead            = 15
	opWrite           = 16
	opStatfs          = 17
	opRelease         = 18
	opFsync           = 20
	opSetxattr        = 21
	opRemovexattr     = 24
	opFlush           = 25
	opInit            = 26
	opOpendir         = 27
	opReaddir         = 28
	opReleasedir      = 29
	opFsyncdir        = 30
	opAccess          = 34
	opCreate          = 35
	opInterrupt       = 36
	opDestroy         = 38
	opBatchForget     = 42
	opFallocate       = 43
	opRename2         = 45
	opCopyFileRange   = 47
	opTmpfile         = 51
	opCopyFileRange64 = 53
)

// INIT flags (flags2 is the high 32 bits).
const (
	initAsyncRead         = 1 << 0
	initAtomicOTrunc      = 1 << 3
	initBigWrites         = 1 << 5
	initParallelDirops    = 1 << 18
	initMaxPages          = 1 << 22
	initExt               = 1 << 30
	initDirectIOAllowMmap = 1 << 36
	initPassthrough       = 1 << 37
	initNoExportSupport   = 1 << 38
	initHasResend         = 1 << 39

	// wantedFlags is everything we ask for. Never DIRECT_IO_ALLOW_MMAP (it
	// lets MAP_SHARED writes through a write open again), passthrough (the
	// kernel would reopen the backing file read-write), writeback cache,
	// splice or AUTO_INVAL_DATA (attribute changes must not drop the cache).
	wantedFlags = initAsyncRead | initAtomicOTrunc | initBigWrites | initParallelDirops |
		initMaxPages | initNoExportSupport
)

// OPEN reply flags.
const (
	fopenDirectIO  = 1 << 0
	fopenKeepCache = 1 << 1
)

// Notifications: written with unique 0 and the code in the error field.
const (
	notifyInvalInode = 2
	// notifyResend: the kernel queues again the requests a server read and
	// did not answer, their uniques with bit 63 set (answered like any other).
	notifyResend = 7
)

var le = binary.LittleEndian

// outMessage starts a reply or notification of payload bytes: the header is
// filled, the payload is the caller's to write at [outHeaderSize:].
func outMessage(unique uint64, errno int32, payload int) []byte {
	b := make([]byte, outHeaderSize+payload)
	le.PutUint32(b[0:], uint32(len(b)))
	le.PutUint32(b[4:], uint32(errno))
	le.PutUint64(b[8:], unique)
	return b
}

// putAttr writes a fuse_attr: modes and ownership are the server's, never the
// tree's (root 0700, directories 0555, files 0444, all owned by root).
func putAttr(b []byte, a Attr) {
	mode := uint32(0o40555)
	nlink := uint32(2)
	switch {
	case a.Node == rootNode:
		mode = 0o40700
	case a.Kind == File:
		mode, nlink = 0o100444, 1
		le.PutUint64(b[8:], uint64(a.Size))
		le.PutUint64(b[16:], uint64((a.Size+511)/512))
	}
	le.PutUint64(b[0:], a.Node)
	le.PutUint32(b[60:], mode)
	le.PutUint32(b[64:], nlink)
	le.PutUint32(b[80:], 4096) // blksize
}

// putEntry writes a fuse_entry_out for a, cached for valid seconds.
func putEntry(b []byte, a Attr, valid uint64) {
	le.PutUint64(b[0:], a.Node)
	le.PutUint64(b[16:], valid)
	le.PutUint64(b[24:], attrValid)
	putAttr(b[40:], a)
}
