package fusefs

import (
	"context"
	"errors"
	"testing"

	"golang.org/x/sys/unix"
)

// TestInitAsksOnlyForWhatIsSafe: offered everything (as kernel 6.18 offers
// DIRECT_IO_ALLOW_MMAP, passthrough, writeback cache and splice), the server
// takes the protocol minor it pins and none of those.
func TestInitAsksOnlyForWhatIsSafe(t *testing.T) {
	k, fd := newFakeKernel(t)
	c, out, err := k.accept(fd, 45, 1<<44-1)
	if err != nil {
		t.Fatal(err)
	}
	flags := uint64(le.Uint32(out[12:])) | uint64(le.Uint32(out[32:]))<<32
	if got := le.Uint32(out[4:]); got != ourMinor {
		t.Errorf("minor %d, want %d", got, ourMinor)
	}
	forbidden := map[string]uint64{"DIRECT_IO_ALLOW_MMAP": initDirectIOAllowMmap, "PASSTHROUGH": initPassthrough,
		"WRITEBACK_CACHE": 1 << 16, "SPLICE_WRITE": 1 << 7, "SPLICE_MOVE": 1 << 8, "SPLICE_READ": 1 << 9,
		"AUTO_INVAL_DATA": 1 << 12, "POSIX_LOCKS": 1 << 1, "DO_READDIRPLUS": 1 << 13, "HANDLE_KILLPRIV": 1 << 19}
	for name, bit := range forbidden {
		if flags&bit != 0 {
			t.Errorf("INIT asked for %s", name)
		}
	}
	for name, bit := range map[string]uint64{"ASYNC_READ": initAsyncRead, "ATOMIC_O_TRUNC": initAtomicOTrunc, "MAX_PAGES": initMaxPages} {
		if flags&bit == 0 {
			t.Errorf("INIT did not ask for %s", name)
		}
	}
	if mw, mp, ra := le.Uint32(out[20:]), le.Uint16(out[28:]), le.Uint32(out[8:]); mw != maxWrite || mp != maxPages || ra > MaxRead {
		t.Errorf("max_write %d, max_pages %d, max_readahead %d", mw, mp, ra)
	}
	if st := c.State(); st.Minor != ourMinor || !st.ResendSupported() || st.Flags != flags&^initExt {
		t.Errorf("state %+v, agreed flags %#x", st, flags)
	}
}

// TestInitRefusesAnOldKernel: before 7.31 the structs differ; say so.
func TestInitRefusesAnOldKernel(t *testing.T) {
	k, fd := newFakeKernel(t)
	_, _, err := k.accept(fd, 30, initAsyncRead)
	if err == nil {
		t.Fatal("Accept took a 7.30 kernel")
	}
}

// TestResumeRefusesAForeignState: a state from a protocol this server does
// not speak is not served.
func TestResumeRefusesAForeignState(t *testing.T) {
	_, fd := newFakeKernel(t)
	for _, minor := range []uint32{0, 30, ourMinor + 1} {
		if _, err := Resume(fd, State{Minor: minor}); err == nil {
			t.Errorf("Resume took minor %d", minor)
		}
	}
}

// TestResumeWritesResend: RESEND is the first thing a resumed server writes.
func TestResumeWritesResend(t *testing.T) {
	k, fd := newFakeKernel(t)
	c, err := Resume(fd, State{Minor: ourMinor, KernelFlags: initHasResend})
	if err != nil || !c.Resent() {
		t.Fatalf("Resume: %v, resent %v", err, c != nil && c.Resent())
	}
	b := make([]byte, 64)
	n, err := unix.Read(k.fd, b)
	if err != nil || n != outHeaderSize || le.Uint32(b[4:]) != notifyResend || le.Uint64(b[8:]) != 0 {
		t.Fatalf("wrote %x (%v), want a RESEND notification", b[:n], err)
	}
}

// TestAcceptStopsWithItsContext: no INIT comes, the caller gives up.
func TestAcceptStopsWithItsContext(t *testing.T) {
	_, fd := newFakeKernel(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { _, err := Accept(ctx, fd); done <- err }()
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Accept returned %v, want context.Canceled", err)
	}
}
