package vmstate

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// mappedState is a stand-in for a mapped-ram file of n bytes: a header,
// stretches of random pages and long runs of zero pages (the holes).
func mappedState(t testing.TB, n int) []byte {
	b := make([]byte, n)
	copy(b, "QEVM\x00\x00\x00\x03 header")
	for off := 1 << 20; off < n; off += 3 << 20 {
		if _, err := rand.Read(b[off:min(off+256<<10, n)]); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := rand.Read(b[n-4096:]); err != nil { // device state, at the end
		t.Fatal(err)
	}
	return b
}

// watchedRepo records the source VM's run state when the first chunk is
// stored.
type watchedRepo struct {
	ociimage.Repository
	q          *qmptest.FakeQEMU
	once       sync.Once
	firstPutVM string
	puts       int
	mu         sync.Mutex
}

func (r *watchedRepo) PutBlob(ctx context.Context, desc ocispec.Descriptor, data []byte) error {
	r.once.Do(func() { r.firstPutVM = r.q.Status() })
	r.mu.Lock()
	r.puts++
	r.mu.Unlock()
	return r.Repository.PutBlob(ctx, desc, data)
}

func emptyDir(t *testing.T, dir string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 0 {
		t.Fatalf("the staging directory holds %d file(s), want none: %v", len(ents), ents[0].Name())
	}
}

func mappedSource(t *testing.T, state []byte) *qmptest.FakeQEMU {
	q := qmptest.NewFakeQEMU(t, "running", state)
	q.EnableMappedRAM()
	q.Lock()
	q.MultifdChannels = 3 // to see it put back
	q.Unlock()
	return q
}

func TestMappedRAMCheckpointAndRestore(t *testing.T) {
	for _, tc := range []struct {
		mode        Mode
		wantRunning bool
		firstPutVM  string // the source's state when the first chunk is stored
	}{{ModeSnapshot, true, "running"}, {ModePause, false, "postmigrate"}} {
		t.Run(string(tc.mode), func(t *testing.T) {
			state := mappedState(t, 9<<20+4096)
			q := mappedSource(t, state)
			staging := t.TempDir()
			dir := t.TempDir()
			repo := &watchedRepo{Repository: openLayout(t, "oci:"+dir+":vm"), q: q}
			res, err := Checkpoint(context.Background(), q.Dial(t), repo, CheckpointOptions{
				Mode: tc.mode, Format: FormatMappedRAM, StagingDir: staging, Stream: chunk.StreamOptions{ChunkSize: 1 << 20},
			})
			if err != nil {
				t.Fatal(err)
			}
			if res.Config.Format != FormatMappedRAM || res.Config.RawBytes != int64(len(state)) {
				t.Fatalf("config %+v: want format mapped-ram of %d bytes", res.Config, len(state))
			}
			if res.Config.DataBytes <= 0 || res.Config.DataBytes >= res.Config.RawBytes/2 {
				t.Fatalf("config declares %d data bytes of %d: the file was not sparse", res.Config.DataBytes, res.Config.RawBytes)
			}
			if res.VMRunning != tc.wantRunning || (q.Status() == "running") != tc.wantRunning {
				t.Fatalf("VM running = %v (QEMU says %s), want %v", res.VMRunning, q.Status(), tc.wantRunning)
			}
			if repo.firstPutVM != tc.firstPutVM {
				t.Fatalf("the source was %s when the first chunk was stored, want %s", repo.firstPutVM, tc.firstPutVM)
			}
			q.Lock()
			uris, caps, channels, bw := slices.Clone(q.MigrateURIs), q.Caps, q.MultifdChannels, q.Bandwidth
			q.Unlock()
			if len(uris) != 1 || !strings.HasPrefix(uris[0], "file:/dev/fdset/") {
				t.Fatalf("migrate URIs %v, want one file:/dev/fdset/N", uris)
			}
			if caps["mapped-ram"] || caps["multifd"] || channels != 3 || bw != 128<<20 {
				t.Fatalf("settings not put back: caps %v, multifd-channels %d, max-bandwidth %d", caps, channels, bw)
			}
			if q.FDSets() != 0 {
				t.Fatalf("QEMU still holds %d fdset(s)", q.FDSets())
			}
			emptyDir(t, staging)
			// Chunks are cut at fixed offsets.
			for i, l := range res.Stream.Layers {
				want := 1 << 20
				if i == len(res.Stream.Layers)-1 {
					want = len(state) - i<<20
				}
				if l.Annotations[ociimage.AnnotationRawSize] != strconv.Itoa(want) || l.Annotations[ociimage.AnnotationRawOffset] != strconv.Itoa(i<<20) {
					t.Fatalf("chunk %d: %v, want %d bytes at %d", i, l.Annotations, want, i<<20)
				}
			}
			if tc.mode == ModeSnapshot && res.Downtime <= 0 {
				t.Fatalf("downtime %v", res.Downtime)
			}

			// Restore into a QEMU 9 waiting for it.
			dst := qmptest.NewFakeQEMU(t, "inmigrate", state)
			dst.EnableMappedRAM()
			rstaging := t.TempDir()
			rr, err := Restore(context.Background(), dst.Dial(t), openLayout(t, "oci:"+dir+"@"+res.Manifest.Digest.String()), RestoreOptions{StagingDir: rstaging})
			if err != nil {
				t.Fatal(err)
			}
			dst.WaitMigrations()
			if !bytes.Equal(dst.Received, state) || rr.RawBytes != int64(len(state)) || rr.Config.Format != FormatMappedRAM {
				t.Fatalf("target loaded %d bytes (equal %v), result %+v", len(dst.Received), bytes.Equal(dst.Received, state), rr)
			}
			if dst.Status() != "running" || !rr.VMRunning {
				t.Fatalf("target is %s after restore", dst.Status())
			}
			dst.Lock()
			duris := slices.Clone(dst.MigrateURIs)
			dst.Unlock()
			if len(duris) != 1 || !strings.HasPrefix(duris[0], "file:/dev/fdset/") || dst.FDSets() != 0 {
				t.Fatalf("target: URIs %v, %d fdset(s) left", duris, dst.FDSets())
			}
			emptyDir(t, rstaging)
		})
	}
}

func TestMappedRAMSecondCheckpointUploadsLittle(t *testing.T) {
	state := mappedState(t, 16<<20)
	q := mappedSource(t, state)
	dir := t.TempDir()
	opts := CheckpointOptions{Mode: ModeSnapshot, StagingDir: t.TempDir(), Stream: chunk.StreamOptions{ChunkSize: 1 << 20}}
	first, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+dir+":vm"), opts)
	if err != nil {
		t.Fatal(err)
	}
	// The guest writes one page and zeroes another.
	next := slices.Clone(state)
	copy(next[5<<20+8192:], "a page the guest wrote")
	clear(next[1<<20 : 1<<20+4096])
	q.Lock()
	q.State = next
	q.Unlock()
	second, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+dir+":vm"), opts)
	if err != nil {
		t.Fatal(err)
	}
	changed := 0
	for i := range first.Stream.Layers {
		if first.Stream.Layers[i].Digest != second.Stream.Layers[i].Digest {
			changed++
		}
	}
	if changed != 2 || second.Stream.UploadedBytes >= first.Stream.UploadedBytes/4 {
		t.Fatalf("%d chunks changed, %d bytes uploaded (first: %d): want 2 chunks, little uploaded", changed, second.Stream.UploadedBytes, first.Stream.UploadedBytes)
	}
}

// checkpointMappedInto stores a mapped-ram image of state and returns its
// layout directory and pinned reference.
func checkpointMappedInto(t *testing.T, state []byte) (string, string) {
	t.Helper()
	q := mappedSource(t, state)
	dir := t.TempDir()
	res, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+dir+":vm"), CheckpointOptions{
		Mode: ModePause, Format: FormatMappedRAM, StagingDir: t.TempDir(), Stream: chunk.StreamOptions{ChunkSize: 1 << 20},
	})
	if err != nil {
		t.Fatal(err)
	}
	return dir, "oci:" + dir + "@" + res.Manifest.Digest.String()
}

func TestMappedRAMRefusedByQEMUWithoutIt(t *testing.T) {
	state := mappedState(t, 4<<20)
	_, ref := checkpointMappedInto(t, state)
	dst := qmptest.NewFakeQEMU(t, "inmigrate", state) // QEMU 7.2: no mapped-ram
	_, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref), RestoreOptions{StagingDir: t.TempDir()})
	if errcode.Of(err) != errcode.CompatMismatch {
		t.Fatalf("err = %v, want COMPAT_MISMATCH", err)
	}
	var coded *errcode.Error
	if !errors.As(err, &coded) || !strings.Contains(strings.Join(coded.Details, "\n"), "lacks the mapped-ram migration capability") ||
		!strings.Contains(err.Error(), "mapped-ram") {
		t.Fatalf("the refusal does not name the missing capability: %v (%+v)", err, coded)
	}
	for _, c := range []string{"add-fd", "getfd", "migrate-incoming", "migrate-set-capabilities"} {
		if slices.Contains(dst.Commands(), c) {
			t.Fatalf("target received %s after a mismatch: %v", c, dst.Commands())
		}
	}
	if dst.Status() != "inmigrate" {
		t.Fatalf("target is %s, want still inmigrate", dst.Status())
	}
}

func TestMappedRAMCorruptChunkNeverReachesQEMU(t *testing.T) {
	state := mappedState(t, 6<<20)
	dir, ref := checkpointMappedInto(t, state)
	repo := openLayout(t, ref)
	_, m, _, err := LoadConfig(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	// The last chunk: a stream restore would have fed QEMU all the others.
	last := m.Layers[len(m.Layers)-1].Digest
	blob := filepath.Join(dir, "blobs", "sha256", last.Encoded())
	b, err := os.ReadFile(blob)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 1
	if err := os.WriteFile(blob, b, 0o644); err != nil {
		t.Fatal(err)
	}
	dst := qmptest.NewFakeQEMU(t, "inmigrate", state)
	dst.EnableMappedRAM()
	staging := t.TempDir()
	_, err = Restore(context.Background(), dst.Dial(t), repo, RestoreOptions{StagingDir: staging})
	if errcode.Of(err) != errcode.DigestMismatch {
		t.Fatalf("err = %v, want DIGEST_MISMATCH", err)
	}
	for _, c := range []string{"add-fd", "migrate-incoming", "migrate-set-capabilities"} {
		if slices.Contains(dst.Commands(), c) {
			t.Fatalf("target received %s: %v", c, dst.Commands())
		}
	}
	if dst.Status() != "inmigrate" {
		t.Fatalf("target is %s, want untouched", dst.Status())
	}
	emptyDir(t, staging)
}

func TestFormatChoice(t *testing.T) {
	state := chunkdata.Stream(t, 1<<20)
	for _, tc := range []struct {
		name      string
		qemu9     bool
		mode      Mode
		format    Format
		free      int64 // staging space; 0: plenty
		staging   string
		want      Format
		wantErr   errcode.Code
		noCommand string // never sent
	}{
		{"7.2 auto", false, ModeSnapshot, FormatAuto, 0, "", "", "", "add-fd"},
		{"7.2 default", false, ModePause, "", 0, "", "", "", "add-fd"},
		{"7.2 mapped-ram", false, ModeSnapshot, FormatMappedRAM, 0, "", "", errcode.Usage, "stop"},
		{"9 auto", true, ModeSnapshot, FormatAuto, 0, "", FormatMappedRAM, "", "getfd"},
		{"9 stream", true, ModePause, FormatStream, 0, "", "", "", "add-fd"},
		{"9 auto, pause mode", true, ModePause, FormatAuto, 0, "", "", "", "add-fd"},
		{"9 mapped-ram, pause mode", true, ModePause, FormatMappedRAM, 0, "", FormatMappedRAM, "", "getfd"},
		{"9 live", true, ModeLive, FormatAuto, 0, "", "", "", "add-fd"},
		{"9 live mapped-ram", true, ModeLive, FormatMappedRAM, 0, "", "", errcode.Usage, "stop"},
		{"9 auto, staging full", true, ModeSnapshot, FormatAuto, 1 << 20, "", "", "", "add-fd"},
		{"9 mapped-ram, staging full", true, ModeSnapshot, FormatMappedRAM, 1 << 20, "", "", errcode.Internal, "stop"},
		{"unknown", true, ModeSnapshot, "qcow2", 0, "", "", errcode.Usage, "stop"},
		{"9 auto, no staging dir", true, ModeSnapshot, FormatAuto, 0, "/nonexistent/vmsnap", "", "", "add-fd"},
		{"9 mapped-ram, no staging dir", true, ModeSnapshot, FormatMappedRAM, 0, "/nonexistent/vmsnap", "", errcode.Internal, "stop"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.free != 0 {
				old := freeSpace
				freeSpace = func(string) (int64, error) { return tc.free, nil }
				t.Cleanup(func() { freeSpace = old })
			}
			q := qmptest.NewFakeQEMU(t, "running", state)
			if tc.qemu9 {
				q.EnableMappedRAM()
			}
			staging := tc.staging
			if staging == "" {
				staging = t.TempDir()
			}
			res, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"),
				CheckpointOptions{Mode: tc.mode, Format: tc.format, StagingDir: staging})
			if errcode.Of(err) != tc.wantErr {
				t.Fatalf("err = %v, want %q", err, tc.wantErr)
			}
			if slices.Contains(q.Commands(), tc.noCommand) {
				t.Fatalf("QEMU received %s: %v", tc.noCommand, q.Commands())
			}
			if tc.wantErr != "" {
				if q.Status() != "running" {
					t.Fatalf("VM is %s after a refused checkpoint", q.Status())
				}
				return
			}
			if res.Config.Format != tc.want {
				t.Fatalf("format %q, want %q", res.Config.Format, tc.want)
			}
			q.Lock()
			caps := q.Caps
			q.Unlock()
			if caps["mapped-ram"] || caps["multifd"] {
				t.Fatalf("capabilities left on: %v", caps)
			}
		})
	}
}

// QEMU runs out of space in the staging directory: INTERNAL naming the
// directory, the VM running, nothing left behind.
func TestMappedRAMStagingFullContinuesVM(t *testing.T) {
	for _, mode := range []Mode{ModePause, ModeSnapshot} {
		t.Run(string(mode), func(t *testing.T) {
			q := mappedSource(t, mappedState(t, 4<<20))
			q.Lock()
			q.FileErrorDesc = "Unable to write to file: No space left on device"
			q.Unlock()
			staging := t.TempDir()
			dir := t.TempDir()
			_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+dir+":vm"), CheckpointOptions{Mode: mode, Format: FormatMappedRAM, StagingDir: staging})
			if errcode.Of(err) != errcode.Internal || !strings.Contains(err.Error(), staging) || !strings.Contains(err.Error(), "full") {
				t.Fatalf("err = %v, want INTERNAL naming the full staging directory %s", err, staging)
			}
			if msg := err.Error(); strings.Count(msg, "is full") != 1 || strings.Count(msg, "stagingDir") != 1 {
				t.Fatalf("err = %v: want the advice once", err)
			}
			if q.Status() != "running" {
				t.Fatalf("VM is %s, want running", q.Status())
			}
			if q.FDSets() != 0 {
				t.Fatalf("QEMU still holds %d fdset(s)", q.FDSets())
			}
			emptyDir(t, staging)
			if _, err := openLayout(t, "oci:"+dir+":vm").Resolve(context.Background()); err == nil {
				t.Fatal("a failed checkpoint left a tag")
			}
		})
	}
}

func TestMappedRAMRestoreStagingTooSmall(t *testing.T) {
	state := mappedState(t, 4<<20)
	_, ref := checkpointMappedInto(t, state)
	old := freeSpace
	freeSpace = func(string) (int64, error) { return 1 << 20, nil }
	t.Cleanup(func() { freeSpace = old })
	dst := qmptest.NewFakeQEMU(t, "inmigrate", state)
	dst.EnableMappedRAM()
	staging := t.TempDir()
	_, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref), RestoreOptions{StagingDir: staging})
	if errcode.Of(err) != errcode.Internal || !strings.Contains(err.Error(), staging) {
		t.Fatalf("err = %v, want INTERNAL naming %s", err, staging)
	}
	if dst.Status() != "inmigrate" || slices.Contains(dst.Commands(), "migrate-incoming") {
		t.Fatalf("target touched: %s, %v", dst.Status(), dst.Commands())
	}
}

func TestConfigFormatIsChecked(t *testing.T) {
	for _, c := range []struct {
		cfg Config
		ok  bool
	}{
		{Config{}, true},
		{Config{Format: FormatStream}, true},
		{Config{Format: FormatMappedRAM, RawBytes: 10, DataBytes: 4}, true},
		{Config{Format: FormatMappedRAM, RawBytes: 10, DataBytes: 11}, false},
		{Config{Format: FormatMappedRAM, RawBytes: 10, DataBytes: -1}, false},
		{Config{DataBytes: 1}, false},
		{Config{Format: "mapped-ram-v2"}, false},
	} {
		if err := c.cfg.checkFormat(); (err == nil) != c.ok || (err != nil && errcode.Of(err) != errcode.InvalidInput) {
			t.Errorf("%+v: %v", c.cfg, err)
		}
	}
}

func TestFixedChunks(t *testing.T) {
	data := chunkdata.Stream(t, 5<<20+12345)
	store := chunkdata.NewStore()
	res, err := chunk.EncodeStream(context.Background(), bytes.NewReader(data), store, chunk.StreamOptions{ChunkSize: 1<<20 + 1000, Fixed: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Layers) != 6 {
		t.Fatalf("%d chunks, want 6 of 1 MiB", len(res.Layers))
	}
	for i, l := range res.Layers[:5] {
		if l.Annotations[ociimage.AnnotationRawSize] != strconv.Itoa(1<<20) {
			t.Fatalf("chunk %d holds %s bytes", i, l.Annotations[ociimage.AnnotationRawSize])
		}
	}
	var out bytes.Buffer
	if _, err := chunk.DecodeStream(context.Background(), res.Layers, store, &out, chunk.StreamOptions{}); err != nil || !bytes.Equal(out.Bytes(), data) {
		t.Fatalf("round trip: %v", err)
	}
}

// sparseReader gives a sparse file's bytes, holes included; sparseWriter
// writes them back as sparse.
func TestSparseReaderAndWriter(t *testing.T) {
	dir := t.TempDir()
	f, err := os.Create(filepath.Join(dir, "sparse"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	want := mappedState(t, 8<<20+100)
	for off := 0; off < len(want); off += 4096 {
		p := want[off:min(off+4096, len(want))]
		if !bytes.Equal(p, make([]byte, len(p))) {
			if _, err := f.WriteAt(p, int64(off)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := f.Truncate(int64(len(want))); err != nil {
		t.Fatal(err)
	}
	for _, bufSize := range []int{1, 4093, 1 << 20} {
		r := &sparseReader{f: f, size: int64(len(want))}
		buf := make([]byte, bufSize)
		var got []byte
		for {
			n, err := r.Read(buf)
			got = append(got, buf[:n]...)
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("sparseReader with %d-byte reads: %d bytes, equal %v", bufSize, len(got), bytes.Equal(got, want))
		}
	}
	// Through the writer, in odd pieces.
	g, err := os.Create(filepath.Join(dir, "copy"))
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if err := g.Truncate(int64(len(want))); err != nil {
		t.Fatal(err)
	}
	w := &sparseWriter{f: g}
	for off := 0; off < len(want); off += 700001 {
		if _, err := w.Write(want[off:min(off+700001, len(want))]); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(g.Name())
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("sparseWriter: %v, equal %v", err, bytes.Equal(got, want))
	}
	fi, _ := g.Stat()
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Blocks*512 > int64(len(want))/2 {
		t.Fatalf("the written file takes %d bytes for %d, mostly zeros: not sparse", st.Blocks*512, len(want))
	}
}

// QEMU 9.0 keeps a removed fdset's descriptor open while the VM is stopped,
// and a remove-fd may be lost: the staging file's space is freed all the
// same, through our own descriptor, on success and on failure, on either
// side.
func TestMappedRAMStagingFreedWhileQEMUHoldsIt(t *testing.T) {
	freed := func(t *testing.T, q *qmptest.FakeQEMU) {
		t.Helper()
		q.WaitMigrations()
		files, err := q.HeldFiles()
		if err != nil {
			t.Fatal(err)
		}
		if len(files) != 1 {
			t.Fatalf("QEMU holds %d file(s), want the staging file, removed but held", len(files))
		}
		if h := files[0]; h.Size != 0 || h.Allocated != 0 {
			t.Fatalf("QEMU holds a staging file of %d bytes (%d allocated): its space was not freed", h.Size, h.Allocated)
		}
	}
	state := mappedState(t, 6<<20)
	checkpoint := func(t *testing.T, q *qmptest.FakeQEMU) (string, error) {
		dir := t.TempDir()
		res, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+dir+":vm"), CheckpointOptions{
			Mode: ModePause, Format: FormatMappedRAM, StagingDir: t.TempDir(), Stream: chunk.StreamOptions{ChunkSize: 1 << 20},
		})
		if err != nil {
			return "", err
		}
		return "oci:" + dir + "@" + res.Manifest.Digest.String(), nil
	}

	t.Run("checkpoint, pause mode", func(t *testing.T) {
		q := mappedSource(t, state)
		q.HoldRemovedFDs(t)
		if _, err := checkpoint(t, q); err != nil {
			t.Fatal(err)
		}
		if q.Status() == "running" {
			t.Fatal("the VM runs after a pause-mode checkpoint")
		}
		freed(t, q)
	})
	t.Run("checkpoint fails", func(t *testing.T) {
		q := mappedSource(t, state)
		q.HoldRemovedFDs(t)
		q.Lock()
		q.FileErrorDesc = "Unable to write to file: Input/output error" // after writing half the state
		q.Unlock()
		if _, err := checkpoint(t, q); err == nil {
			t.Fatal("the checkpoint succeeded")
		}
		freed(t, q)
	})

	ref, err := checkpoint(t, mappedSource(t, state))
	if err != nil {
		t.Fatal(err)
	}
	restore := func(t *testing.T, dst *qmptest.FakeQEMU) error {
		_, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref), RestoreOptions{Paused: true, StagingDir: t.TempDir()})
		return err
	}
	t.Run("restore, paused", func(t *testing.T) {
		dst := qmptest.NewFakeQEMU(t, "inmigrate", state)
		dst.EnableMappedRAM()
		dst.HoldRemovedFDs(t)
		if err := restore(t, dst); err != nil {
			t.Fatal(err)
		}
		if dst.Status() != "paused" {
			t.Fatalf("target is %s, want paused", dst.Status())
		}
		freed(t, dst)
	})
	t.Run("restore, QEMU fails to load", func(t *testing.T) {
		dst := qmptest.NewFakeQEMU(t, "inmigrate", mappedState(t, len(state))) // another VM's state
		dst.EnableMappedRAM()
		dst.HoldRemovedFDs(t)
		if err := restore(t, dst); err == nil {
			t.Fatal("the restore succeeded")
		}
		freed(t, dst)
	})
}
