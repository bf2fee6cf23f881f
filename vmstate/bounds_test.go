package vmstate

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// lyingCheckpoint checkpoints q, which claims memory bytes of RAM and lies
// as set up, and checks what must hold whatever the lie: QMP_ERROR saying
// the state was too large, the VM running again, no tag, nothing left in
// the staging directory and nothing QEMU still holds taking space.
func lyingCheckpoint(t *testing.T, q *qmptest.FakeQEMU, format Format) {
	t.Helper()
	staging, store := t.TempDir(), t.TempDir()
	start := time.Now()
	_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+store+":vm"),
		CheckpointOptions{Mode: ModeSnapshot, Format: format, StagingDir: staging})
	t.Logf("%s: failed after %v: %v", format, time.Since(start).Round(time.Millisecond), err)
	if errcode.Of(err) != errcode.QMPError || !strings.Contains(err.Error(), "whose state takes at most") || !strings.Contains(err.Error(), "the VM was continued") {
		t.Fatalf("err = %v (code %s), want QMP_ERROR saying the state was too large and the VM continued", err, errcode.Of(err))
	}
	if q.Status() != "running" {
		t.Fatalf("the VM is %s, want running", q.Status())
	}
	if _, err := openLayout(t, "oci:"+store+":vm").Resolve(context.Background()); err == nil {
		t.Fatal("the aborted checkpoint left a tag")
	}
	emptyDir(t, staging)
	q.WaitMigrations()
	files, err := q.HeldFiles()
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range files {
		if h.Size != 0 || h.Allocated != 0 {
			t.Fatalf("QEMU holds a staging file of %d bytes (%d allocated): its space was not freed", h.Size, h.Allocated)
		}
	}
}

// TestMappedRAMStagingBoundedAgainstGrowingFile: a QEMU that claims 16 MiB
// of memory and writes its mapped-ram file without end is stopped near the
// bound (memory + 10% + 256 MiB), not at the disk's end.
func TestMappedRAMStagingBoundedAgainstGrowingFile(t *testing.T) {
	const memory = 16 << 20
	q := mappedSource(t, mappedState(t, 4<<20))
	q.HoldRemovedFDs(t)
	q.Lock()
	q.Memory, q.LieGrow = memory, true
	q.Unlock()
	lyingCheckpoint(t, q, FormatMappedRAM)
	q.Lock()
	size, alloc := q.FileMaxSize, q.FileMaxAllocated
	q.Unlock()
	bound := maxStateBytes(memory)
	t.Logf("bound %d MiB; the file reached %d MiB (%d MiB allocated) before it was freed", bound>>20, size>>20, alloc>>20)
	if size < bound {
		t.Fatalf("the fake wrote only %d MiB, under the %d MiB bound: the test proves nothing", size>>20, bound>>20)
	}
	// What QEMU writes between two looks (50ms) gets through; a loaded
	// machine can delay a look. Unbounded would be the fake's 4 GiB.
	if size > bound+512<<20 {
		t.Fatalf("the file grew to %d MiB, far past the %d MiB bound", size>>20, bound>>20)
	}
}

// TestMappedRAMStagingBoundedAgainstSparseFile: a QEMU that completes with
// a 1 TiB (sparse) file is refused before a byte of it is chunked.
func TestMappedRAMStagingBoundedAgainstSparseFile(t *testing.T) {
	q := mappedSource(t, mappedState(t, 4<<20))
	q.HoldRemovedFDs(t)
	q.Lock()
	q.Memory, q.LieSparseSize = 16<<20, 1<<40
	q.Unlock()
	start := time.Now()
	lyingCheckpoint(t, q, FormatMappedRAM)
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("refusing a 1 TiB file took %v: was it read?", d)
	}
}

// TestStreamBoundedAgainstEndlessStream: a QEMU that claims 16 MiB of
// memory and streams without end is cut off at the bound.
func TestStreamBoundedAgainstEndlessStream(t *testing.T) {
	q := qmptest.NewFakeQEMU(t, "running", chunkdata.Random(1, 1<<20))
	q.Lock()
	q.Memory, q.LieStream = 16<<20, true
	q.Unlock()
	lyingCheckpoint(t, q, FormatStream)
}

func TestBoundedStream(t *testing.T) {
	const memory = 1 << 20
	n := maxStateBytes(memory)
	for _, tc := range []struct {
		size int64
		ok   bool
	}{{n, true}, {n + 1, false}, {n + 1<<20, false}} {
		got, err := io.Copy(io.Discard, newBoundedStream(io.LimitReader(zeroReader{}, tc.size), memory))
		if tc.ok != (err == nil) || (err != nil && errcode.Of(err) != errcode.QMPError) {
			t.Fatalf("a %d-byte stream with a %d-byte bound: %d bytes, %v", tc.size, n, got, err)
		}
		if got > n {
			t.Fatalf("read %d bytes past a %d-byte bound", got, n)
		}
	}
}

type zeroReader struct{}

func (zeroReader) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// TestConfigSizeIsChecked: an image may not declare more state than its
// record's memory explains (a restore would stage or stream it all).
func TestConfigSizeIsChecked(t *testing.T) {
	const memory = 64 << 20
	for _, c := range []struct {
		raw int64
		ok  bool
	}{{1 << 20, true}, {maxStateBytes(memory), true}, {maxStateBytes(memory) + 1, false}, {1 << 40, false}} {
		cfg := Config{Record: Record{MemoryBytes: memory}, Format: FormatMappedRAM, RawBytes: c.raw, DataBytes: 4096}
		if err := cfg.checkSize(); (err == nil) != c.ok || (err != nil && errcode.Of(err) != errcode.InvalidInput) {
			t.Errorf("%d bytes of state for %d of memory: %v", c.raw, memory, err)
		}
	}
}
