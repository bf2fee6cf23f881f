package vmstate

import (
	"fmt"
	"io"
	"os"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// A checkpoint's state comes from the VM's QEMU, which may be under someone
// else's control (a tenant's pod): nothing it claims may make vmsnap store
// or stage more than the VM's memory can explain. The memory is what QEMU
// reported when the checkpoint began (Record.MemoryBytes); QEMU could
// claim more, but a chooser of formats and a caller see that figure, and
// mapped-ram needs that much free space in the staging directory first.

// maxStateBytes is the most state a VM with memory bytes of RAM produces,
// in either format. Both hold each page of RAM at most once (a stopped VM
// is saved in one pass; live mode's background snapshot sends each page
// once): a stream adds about 8 bytes to a 4 KiB page (0.2%), mapped-ram a
// bitmap (a bit a page) and the alignment of each RAMBlock's region (1 MiB).
// Besides guest RAM, RAMBlocks hold device memory (video RAM: 16 MiB for a
// standard VGA, up to 256 MiB for the largest virtual GPUs' defaults) and
// firmware (a few MiB); device state is well under a MiB. A tenth of
// memory plus 256 MiB covers all of that with room to spare, and stays a
// bound a node's disk and a registry quota can be planned with.
func maxStateBytes(memory int64) int64 { return memory + memory/10 + 256<<20 }

// stateTooLarge is the error for a QEMU that sent more than maxStateBytes;
// did says what it did ("wrote 300 MiB").
func stateTooLarge(did string, memory int64) error {
	return errcode.New(errcode.QMPError,
		"QEMU %s of state for a VM with %d MiB of memory, whose state takes at most %d MiB: the QEMU is broken or lies, "+
			"so the checkpoint was aborted", did, memory>>20, maxStateBytes(memory)>>20)
}

// boundedStream reads a migration stream and fails once it passes its
// bound (maxStateBytes, from newBoundedStream): a QEMU that keeps writing
// must not fill a registry, nor a staging file.
type boundedStream struct {
	r       io.Reader
	left    int64
	tooMuch func() error // the error past the bound
}

func newBoundedStream(r io.Reader, memory int64) *boundedStream {
	return &boundedStream{r: r, left: maxStateBytes(memory), tooMuch: func() error {
		return stateTooLarge(fmt.Sprintf("sent over %d MiB", maxStateBytes(memory)>>20), memory)
	}}
}

func (b *boundedStream) Read(p []byte) (int, error) {
	if b.left <= 0 {
		// At the bound: one more byte is one too many.
		var one [1]byte
		if n, err := b.r.Read(one[:]); n == 0 {
			return 0, err
		}
		return 0, b.tooMuch()
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.r.Read(p)
	b.left -= int64(n)
	return n, err
}

// checkExtent refuses a finished staging file beyond the bound, whether
// the watch saw it or not: what is chunked is never more than the bound.
func checkExtent(f *os.File, memory int64) (size, allocated int64, err error) {
	size, allocated, err = fileExtent(f)
	if err == nil && (size > maxStateBytes(memory) || allocated > maxStateBytes(memory)) {
		_ = f.Truncate(0)
		return 0, 0, stateTooLarge(fmt.Sprintf("grew the staging file to %d MiB", max(size, allocated)>>20), memory)
	}
	return size, allocated, err
}

// checkSize refuses a config that declares more state than its VM's memory
// explains: a restore stages (mapped-ram) or streams that much, and the
// image may come from anyone.
func (c Config) checkSize() error {
	if c.RawBytes > maxStateBytes(c.Record.MemoryBytes) {
		return errcode.New(errcode.InvalidInput,
			"the image's config declares %d MiB of state for a VM with %d MiB of memory, whose state takes at most %d MiB: no checkpoint of a real VM looks like that",
			c.RawBytes>>20, c.Record.MemoryBytes>>20, maxStateBytes(c.Record.MemoryBytes)>>20)
	}
	return nil
}
