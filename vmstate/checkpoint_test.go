package vmstate

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

func openLayout(t testing.TB, ref string) ociimage.Repository {
	t.Helper()
	r, err := ociimage.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	repo, err := ociimage.Open(context.Background(), r)
	if err != nil {
		t.Fatal(err)
	}
	return repo
}

func TestCheckpointModes(t *testing.T) {
	for _, tc := range []struct {
		mode        Mode
		wantRunning bool
	}{{ModeSnapshot, true}, {ModePause, false}} {
		t.Run(string(tc.mode), func(t *testing.T) {
			state := chunkdata.Stream(t, 3<<20)
			q := qmptest.NewFakeQEMU(t, "running", state)
			dir := t.TempDir()
			repo := openLayout(t, "oci:"+dir+":vm")
			res, err := Checkpoint(context.Background(), q.Dial(t), repo, CheckpointOptions{Mode: tc.mode, Stream: chunk.StreamOptions{ChunkSize: 1 << 20}})
			if err != nil {
				t.Fatal(err)
			}
			if res.VMRunning != tc.wantRunning || (q.Status() == "running") != tc.wantRunning {
				t.Fatalf("VM running = %v (QEMU says %s), want %v", res.VMRunning, q.Status(), tc.wantRunning)
			}
			if res.Stream.RawBytes != int64(len(state)) || res.Config.Record.MemoryBytes != 256<<20 {
				t.Fatalf("captured %d bytes, record %+v", res.Stream.RawBytes, res.Config.Record)
			}
			if !res.Image.IsDigest() || res.Image.Digest != res.Manifest.Digest {
				t.Fatalf("image %s is not pinned to manifest %s", res.Image, res.Manifest.Digest)
			}
			cmds := q.Commands()
			stop, migrate := slices.Index(cmds, "stop"), slices.Index(cmds, "migrate")
			if stop < 0 || migrate < stop || slices.Index(cmds, "migrate-set-parameters") > migrate {
				t.Fatalf("want bandwidth raised, then stop, then migrate; got %v", cmds)
			}
			if q.Bandwidth != 128<<20 {
				t.Fatalf("max-bandwidth left at %d, want it put back", q.Bandwidth)
			}
			// The tag names the checkpoint index, which lists the state
			// manifest, and the stream reads back.
			desc, err := openLayout(t, "oci:"+dir+":vm").Resolve(context.Background())
			if err != nil || desc.Digest != res.Checkpoint.Digest || desc.MediaType != ocispec.MediaTypeImageIndex {
				t.Fatalf("tag resolves to %v, %v; want the checkpoint index %s", desc.Digest, err, res.Checkpoint.Digest)
			}
			tagged, cp, err := ociimage.OpenPart(context.Background(), ociimage.Reference{Layout: dir, Tag: "vm"}, ociimage.PartVMState)
			if err != nil || cp == nil || cp.Ref != res.CheckpointImage {
				t.Fatalf("opening the state through the tag: %v (checkpoint %+v)", err, cp)
			}
			if desc, _ := tagged.Resolve(context.Background()); desc.Digest != res.Manifest.Digest {
				t.Fatalf("the checkpoint lists the state %s, want %s", desc.Digest, res.Manifest.Digest)
			}
			_, m, cfg, err := LoadConfig(context.Background(), tagged)
			if err != nil || cfg.Mode != tc.mode {
				t.Fatalf("LoadConfig: %+v, %v", cfg, err)
			}
			var out bytes.Buffer
			if _, err := chunk.DecodeStream(context.Background(), m.Layers, tagged, &out, chunk.StreamOptions{}); err != nil || !bytes.Equal(out.Bytes(), state) {
				t.Fatalf("stored stream differs from QEMU's (%v)", err)
			}
		})
	}
}

// A failed checkpoint continues the VM and leaves no tag, in every mode.
func TestCheckpointFailureContinuesVMAndLeavesNoTag(t *testing.T) {
	for _, mode := range []Mode{ModePause, ModeSnapshot} {
		t.Run(string(mode), func(t *testing.T) {
			q := qmptest.NewFakeQEMU(t, "running", chunkdata.Stream(t, 2<<20))
			q.FailMigrate = 100 << 10
			dir := t.TempDir()
			_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+dir+":vm"), CheckpointOptions{Mode: mode})
			if errcode.Of(err) != errcode.QMPError {
				t.Fatalf("err = %v, want QMP_ERROR", err)
			}
			if q.Status() != "running" {
				t.Fatalf("VM is %s after a failed checkpoint, want running", q.Status())
			}
			if _, err := openLayout(t, "oci:"+dir+":vm").Resolve(context.Background()); err == nil {
				t.Fatal("a failed checkpoint left a tag")
			}
		})
	}
}

func TestCheckpointStoreFailureContinuesVM(t *testing.T) {
	q := qmptest.NewFakeQEMU(t, "running", chunkdata.Stream(t, 2<<20))
	dir := t.TempDir()
	// A file where the layout directory should be: every blob write fails.
	blocked := filepath.Join(dir, "layout")
	if err := os.WriteFile(blocked, []byte("not a directory"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+blocked+":vm"), CheckpointOptions{Mode: ModePause})
	if err == nil {
		t.Fatal("checkpoint into an unwritable store succeeded")
	}
	if q.Status() != "running" {
		t.Fatalf("VM is %s after a failed pause-mode checkpoint, want running", q.Status())
	}
}

// refusingRepo fails every blob it is given.
type refusingRepo struct{ ociimage.Repository }

func (refusingRepo) PutBlob(context.Context, ocispec.Descriptor, []byte) error {
	return errcode.New(errcode.RegistryError, "the store refused the blob")
}

// When the store fails mid-stream, QEMU's migration fails next on the
// broken pipe: the checkpoint reports the cause, the store's error, not
// QEMU's, and the VM runs.
func TestCheckpointReportsTheStoresFailureNotTheBrokenPipe(t *testing.T) {
	for _, mode := range []Mode{ModePause, ModeSnapshot} {
		t.Run(string(mode), func(t *testing.T) {
			q := qmptest.NewFakeQEMU(t, "running", chunkdata.Stream(t, 8<<20))
			repo := refusingRepo{openLayout(t, "oci:"+t.TempDir()+":vm")}
			_, err := Checkpoint(context.Background(), q.Dial(t), repo, CheckpointOptions{Mode: mode, Stream: chunk.StreamOptions{ChunkSize: 1 << 20}})
			if errcode.Of(err) != errcode.RegistryError || !strings.Contains(err.Error(), "refused the blob") {
				t.Fatalf("err = %v, want the store's REGISTRY_ERROR", err)
			}
			if q.Status() != "running" {
				t.Fatalf("VM is %s after a failed checkpoint, want running", q.Status())
			}
		})
	}
}

func TestCheckpointHookFailureContinuesVM(t *testing.T) {
	q := qmptest.NewFakeQEMU(t, "running", chunkdata.Stream(t, 1<<20))
	dir := t.TempDir()
	hookErr := errcode.New(errcode.InvalidInput, "bad overlay")
	_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+dir+":vm"), CheckpointOptions{
		Mode:         ModePause,
		WhileStopped: func(context.Context) (Link, error) { return Link{}, hookErr },
	})
	if !errors.Is(err, hookErr) || errcode.Of(err) != errcode.InvalidInput || !strings.Contains(err.Error(), "the VM was continued") {
		t.Fatalf("err = %v, want the hook's, saying the VM was continued", err)
	}
	if q.Status() != "running" {
		t.Fatalf("VM is %s, want running", q.Status())
	}
}

func TestCheckpointRefusesIncomingQEMU(t *testing.T) {
	q := qmptest.NewFakeQEMU(t, "inmigrate", nil)
	_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()), CheckpointOptions{})
	if errcode.Of(err) != errcode.InvalidInput {
		t.Fatalf("err = %v, want INVALID_INPUT", err)
	}
}

func TestLiveModeRefusesDiskHook(t *testing.T) {
	q := qmptest.NewFakeQEMU(t, "running", nil)
	_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()), CheckpointOptions{
		Mode: ModeLive, WhileStopped: func(context.Context) (Link, error) { return Link{}, nil },
	})
	if errcode.Of(err) != errcode.Usage || slices.Contains(q.Commands(), "migrate") {
		t.Fatalf("err = %v, commands %v; want USAGE before any migration", err, q.Commands())
	}
}

// checkpointInto stores state as an image and returns its pinned reference.
func checkpointInto(t *testing.T, dir string, state []byte) ociimage.Reference {
	t.Helper()
	src := qmptest.NewFakeQEMU(t, "running", state)
	res, err := Checkpoint(context.Background(), src.Dial(t), openLayout(t, "oci:"+dir+":vm"), CheckpointOptions{Mode: ModePause, Stream: chunk.StreamOptions{ChunkSize: 512 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	return res.Image
}

func TestRestoreLoadsExactStateAndContinues(t *testing.T) {
	for _, paused := range []bool{false, true} {
		state := chunkdata.Stream(t, 3<<20)
		dir := t.TempDir()
		ref := checkpointInto(t, dir, state)
		dst := qmptest.NewFakeQEMU(t, "inmigrate", state)
		res, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref.String()), RestoreOptions{Paused: paused})
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(dst.Received, state) || res.RawBytes != int64(len(state)) {
			t.Fatalf("target received %d bytes, want the %d captured", len(dst.Received), len(state))
		}
		if want := map[bool]string{false: "running", true: "paused"}[paused]; dst.Status() != want {
			t.Fatalf("paused=%v: target is %s, want %s", paused, dst.Status(), want)
		}
		if !dst.Caps["events"] {
			t.Fatal("restore did not turn on MIGRATION events on the target")
		}
	}
}

func TestRestoreRefusesMismatchBeforeSendingAByte(t *testing.T) {
	dir := t.TempDir()
	ref := checkpointInto(t, dir, chunkdata.Stream(t, 1<<20))
	dst := qmptest.NewFakeQEMU(t, "inmigrate", nil)
	dst.Memory = 512 << 20
	_, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref.String()), RestoreOptions{})
	if errcode.Of(err) != errcode.CompatMismatch {
		t.Fatalf("err = %v, want COMPAT_MISMATCH", err)
	}
	for _, c := range []string{"getfd", "migrate-incoming", "cont"} {
		if slices.Contains(dst.Commands(), c) {
			t.Fatalf("target received %s after a mismatch: %v", c, dst.Commands())
		}
	}
	if dst.Status() != "inmigrate" {
		t.Fatalf("target is %s, want still inmigrate", dst.Status())
	}
}

func TestRestoreCorruptFirstChunkNeverReachesQEMU(t *testing.T) {
	dir := t.TempDir()
	ref := checkpointInto(t, dir, chunkdata.Stream(t, 2<<20))
	repo := openLayout(t, ref.String())
	_, m, _, err := LoadConfig(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	flipByte(t, filepath.Join(dir, "blobs", "sha256", m.Layers[0].Digest.Encoded()))
	dst := qmptest.NewFakeQEMU(t, "inmigrate", nil)
	_, err = Restore(context.Background(), dst.Dial(t), repo, RestoreOptions{})
	if errcode.Of(err) != errcode.DigestMismatch {
		t.Fatalf("err = %v, want DIGEST_MISMATCH", err)
	}
	if slices.Contains(dst.Commands(), "migrate-incoming") || dst.Status() != "inmigrate" {
		t.Fatalf("QEMU saw the stream: %v, status %s", dst.Commands(), dst.Status())
	}
}

func TestRestoreCorruptLaterChunkFailsTheLoad(t *testing.T) {
	dir := t.TempDir()
	state := chunkdata.Stream(t, 3<<20)
	ref := checkpointInto(t, dir, state)
	repo := openLayout(t, ref.String())
	_, m, _, err := LoadConfig(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	flipByte(t, filepath.Join(dir, "blobs", "sha256", m.Layers[len(m.Layers)-1].Digest.Encoded()))
	dst := qmptest.NewFakeQEMU(t, "inmigrate", state)
	_, err = Restore(context.Background(), dst.Dial(t), repo, RestoreOptions{})
	if errcode.Of(err) != errcode.DigestMismatch {
		t.Fatalf("err = %v, want DIGEST_MISMATCH", err)
	}
	if slices.Contains(dst.Commands(), "cont") || dst.Status() == "running" {
		t.Fatalf("the target runs after a corrupt restore: %v", dst.Commands())
	}
	dst.WaitMigrations()
	if len(dst.Received) >= len(state) {
		t.Fatalf("target received %d bytes: the corrupt chunk reached it", len(dst.Received))
	}
}

func TestRestoreRefusesRunningQEMU(t *testing.T) {
	dir := t.TempDir()
	ref := checkpointInto(t, dir, chunkdata.Stream(t, 1<<20))
	dst := qmptest.NewFakeQEMU(t, "running", nil)
	_, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref.String()), RestoreOptions{})
	if errcode.Of(err) != errcode.InvalidInput {
		t.Fatalf("err = %v, want INVALID_INPUT", err)
	}
}

func flipByte(t testing.TB, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 0x01
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestCheckpointRefusesVMStoppedByEarlierMigration(t *testing.T) {
	q := qmptest.NewFakeQEMU(t, "running", chunkdata.Stream(t, 1<<20))
	dir := t.TempDir()
	if _, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+dir+":a"), CheckpointOptions{Mode: ModePause}); err != nil {
		t.Fatal(err)
	}
	_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+dir+":b"), CheckpointOptions{Mode: ModePause})
	if errcode.Of(err) != errcode.InvalidInput || !strings.Contains(err.Error(), "cont") {
		t.Fatalf("err = %v, want INVALID_INPUT saying what to do", err)
	}
	if n := strings.Count(strings.Join(q.Commands(), " "), "getfd"); n != 1 {
		t.Fatalf("%d getfd: the refused checkpoint passed a descriptor", n)
	}
}

func TestLiveModeOfPausedVMStaysPaused(t *testing.T) {
	q := qmptest.NewFakeQEMU(t, "paused", chunkdata.Stream(t, 1<<20))
	res, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":a"), CheckpointOptions{Mode: ModeLive})
	if err != nil {
		t.Fatal(err)
	}
	q.Lock()
	bg := q.Caps["background-snapshot"]
	q.Unlock()
	if res.VMRunning || bg {
		t.Fatalf("a paused VM ran (%v) or kept background-snapshot on (%v)", res.VMRunning, bg)
	}
}

func TestCheckpointTurnsOffForeignCapabilitiesAndRestoresThem(t *testing.T) {
	q := qmptest.NewFakeQEMU(t, "running", chunkdata.Stream(t, 1<<20))
	q.Lock()
	q.Caps["multifd"], q.Caps["return-path"] = true, true
	q.Unlock()
	var during map[string]bool
	_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":a"), CheckpointOptions{
		WhileStopped: func(context.Context) (Link, error) {
			q.Lock()
			during = map[string]bool{"multifd": q.Caps["multifd"], "return-path": q.Caps["return-path"], "events": q.Caps["events"]}
			q.Unlock()
			return Link{}, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if during["multifd"] || during["return-path"] || !during["events"] {
		t.Fatalf("capabilities during the checkpoint: %v", during)
	}
	q.Lock()
	defer q.Unlock()
	if !q.Caps["multifd"] || !q.Caps["return-path"] || q.Caps["events"] {
		t.Fatalf("capabilities not put back: %v", q.Caps)
	}
}

func TestFailedMigrateClosesThePassedDescriptor(t *testing.T) {
	q := qmptest.NewFakeQEMU(t, "running", nil)
	q.Lock()
	q.RefuseMigrate = true
	q.Unlock()
	_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":a"), CheckpointOptions{})
	if errcode.Of(err) != errcode.QMPError {
		t.Fatalf("err = %v", err)
	}
	if !slices.Contains(q.Commands(), "closefd") || q.Status() != "running" {
		t.Fatalf("commands %v, status %s: want closefd and a running VM", q.Commands(), q.Status())
	}
}

func TestChunkSizeGrowsWithMemory(t *testing.T) {
	for _, c := range []struct {
		mem  int64
		want int
	}{{256 << 20, 4 << 20}, {16 << 30, 4 << 20}, {32 << 30, 8 << 20}, {64 << 30, 16 << 20}, {1 << 40, 16 << 20}} {
		if got := chunkSizeFor(c.mem, 4<<20); got != c.want {
			t.Errorf("chunkSizeFor(%d GiB) = %d MiB, want %d MiB", c.mem>>30, got>>20, c.want>>20)
		}
	}
	// What is recorded is what the chunker uses: a power of two.
	if got := chunkSizeFor(256<<20, 3<<20); got != 2<<20 {
		t.Errorf("chunkSizeFor(256 MiB, 3 MiB) = %d, want 2 MiB", got)
	}
}
