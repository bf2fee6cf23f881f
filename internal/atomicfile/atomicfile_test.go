package atomicfile

import (
	"bytes"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// sparseData is mostly zeros with a few scattered non-zero runs, some of them
// straddling block boundaries, like an overlay with little guest data.
func sparseData(size int) []byte {
	b := make([]byte, size)
	r := rand.New(rand.NewPCG(1, 2))
	for _, off := range []int{0, 100_000, sparseBlock*5 - 10, size / 2, size - 3} {
		for i := range 20 {
			if off+i < size {
				b[off+i] = byte(r.IntN(255) + 1)
			}
		}
	}
	return b
}

// writeIn writes data in pieces of the given sizes, cycling, so that blocks
// are assembled across Write calls.
func writeIn(t *testing.T, w io.Writer, data []byte, sizes ...int) {
	t.Helper()
	for i := 0; len(data) > 0; i++ {
		n := min(sizes[i%len(sizes)], len(data))
		if got, err := w.Write(data[:n]); err != nil || got != n {
			t.Fatalf("Write(%d bytes) = %d, %v", n, got, err)
		}
		data = data[n:]
	}
}

// leftovers lists the temporary files Create left in dir.
func leftovers(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var tmp []string
	for _, e := range ents {
		if strings.Contains(e.Name(), ".vmsnap-tmp-") {
			tmp = append(tmp, e.Name())
		}
	}
	return tmp
}

func TestAtomicFileSparseCommit(t *testing.T) {
	const size = 8<<20 + 12345 // not a block multiple: the tail is partial
	data := sparseData(size)
	for _, tc := range []struct {
		name  string
		sizes []int
	}{
		{"one write", []int{size}},
		{"io.Copy-sized", []int{32 << 10}},
		{"odd sizes", []int{1, 4097, sparseBlock + 3, 7}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "overlay.qcow2")
			f, err := Create(path, 0o640)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Abort()
			if !strings.HasPrefix(filepath.Base(f.TempPath()), ".overlay.qcow2.vmsnap-tmp-") {
				t.Errorf("temp name %q", f.TempPath())
			}
			writeIn(t, f, data, tc.sizes...)
			if _, err := os.Stat(path); !os.IsNotExist(err) {
				t.Fatalf("target exists before Commit: %v", err)
			}
			if err := f.Commit(); err != nil {
				t.Fatal(err)
			}
			got, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data) {
				t.Fatalf("committed bytes differ (len %d, want %d)", len(got), len(data))
			}
			fi, err := os.Stat(path)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode().Perm()&^0o640 != 0 {
				t.Errorf("mode %v exceeds 0640", fi.Mode())
			}
			// Five 20-byte runs touch at most 7 blocks (448 KiB) of 8 MiB.
			st := fi.Sys().(*syscall.Stat_t)
			if alloc := st.Blocks * 512; alloc >= fi.Size()/4 {
				t.Errorf("file is not sparse: %d bytes allocated for %d", alloc, fi.Size())
			}
			if tmp := leftovers(t, dir); len(tmp) != 0 {
				t.Errorf("temp files left after Commit: %v", tmp)
			}
			// Abort after Commit is a no-op and must not remove the result.
			if err := f.Abort(); err != nil {
				t.Errorf("Abort after Commit: %v", err)
			}
			if _, err := os.Stat(path); err != nil {
				t.Errorf("Abort after Commit removed the file: %v", err)
			}
		})
	}
}

func TestAtomicFileAllZeroAndEmpty(t *testing.T) {
	dir := t.TempDir()
	for _, size := range []int{0, 5, 3 * sparseBlock} {
		path := filepath.Join(dir, "z")
		f, err := Create(path, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		writeIn(t, f, make([]byte, size), max(size, 1))
		if err := f.Commit(); err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		// Nothing was ever written: only Truncate can have set the length.
		if fi.Size() != int64(size) {
			t.Errorf("size %d, want %d", fi.Size(), size)
		}
	}
}

func TestAtomicFileReplacesExisting(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "disk")
	// The old file is longer than the new one: no tail of it may survive.
	if err := os.WriteFile(path, bytes.Repeat([]byte("old"), 100_000), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := Create(path, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	writeIn(t, f, []byte("new"), 3)
	if err := f.Commit(); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(path); string(got) != "new" {
		t.Errorf("content %q, want %q", got, "new")
	}
}

func TestAtomicFileAbort(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "disk")
	f, err := Create(path, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	writeIn(t, f, sparseData(1<<20), 4096)
	if err := f.Abort(); err != nil {
		t.Fatal(err)
	}
	if err := f.Abort(); err != nil {
		t.Errorf("second Abort: %v", err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("target exists after Abort: %v", err)
	}
	if tmp := leftovers(t, dir); len(tmp) != 0 {
		t.Errorf("temp files left after Abort: %v", tmp)
	}
	if _, err := f.Write([]byte("x")); err == nil {
		t.Error("Write after Abort succeeded")
	}
	if err := f.Commit(); err == nil {
		t.Error("Commit after Abort succeeded")
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("target exists after Commit-after-Abort: %v", err)
	}
}

// TestAtomicFileCrash simulates a process that dies mid-write: no Commit and
// no Abort. The original must be untouched; only the temp file remains, under
// a name that cannot be mistaken for the image.
func TestAtomicFileCrash(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "overlay.qcow2")
	orig := []byte("original overlay")
	if err := os.WriteFile(path, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := Create(path, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	writeIn(t, f, bytes.Repeat([]byte{0xab}, 3*sparseBlock), sparseBlock)
	// Crash: the process goes away; we only look at the directory.
	if got, _ := os.ReadFile(path); !bytes.Equal(got, orig) {
		t.Errorf("target changed without Commit: %q", got)
	}
	tmp := leftovers(t, dir)
	if len(tmp) != 1 || !strings.HasPrefix(tmp[0], ".overlay.qcow2.vmsnap-tmp-") {
		t.Errorf("temp files = %v", tmp)
	}
	f.Abort()
}

func TestCreateAtomicMissingDir(t *testing.T) {
	_, err := Create(filepath.Join(t.TempDir(), "no", "such", "file"), 0o644)
	wantCode(t, err, "INTERNAL")
}

// TestAtomicFileSyncThenRead covers checking data before Commit (restore
// reads the header back): after Sync the temp file holds exactly what was
// written, including a buffered partial block, and writing can continue.
func TestAtomicFileSyncThenRead(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "disk")
	data := sparseData(3*sparseBlock + 500)
	data[sparseBlock+10] = 7 // a non-zero byte in the block that will be partial at Sync
	f, err := Create(path, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Abort()
	first := sparseBlock + 100 // ends mid-block
	writeIn(t, f, data[:first], 4096)
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if f.Size() != int64(first) {
		t.Errorf("Size = %d, want %d", f.Size(), first)
	}
	got := make([]byte, first)
	if _, err := f.ReaderAt().ReadAt(got, 0); err != nil {
		t.Fatalf("ReadAt after Sync: %v", err)
	}
	if !bytes.Equal(got, data[:first]) {
		t.Fatal("temp file after Sync differs from what was written")
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("Sync put the file in place: %v", err)
	}
	writeIn(t, f, data[first:], 777)
	if err := f.Commit(); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(path); !bytes.Equal(b, data) {
		t.Fatal("committed bytes differ after Sync and further writes")
	}
}

func wantCode(t testing.TB, err error, want errcode.Code) {
	t.Helper()
	if got := errcode.Of(err); got != want {
		t.Fatalf("error code = %q, want %q (error: %v)", got, want, err)
	}
}
