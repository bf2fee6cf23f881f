package vmstate

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
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
			state := testStream(t, 3<<20)
			q := newFakeQEMU(t, "running", state)
			dir := t.TempDir()
			repo := openLayout(t, "oci:"+dir+":vm")
			res, err := Checkpoint(context.Background(), q.dial(t), repo, CheckpointOptions{Mode: tc.mode, Stream: StreamOptions{ChunkSize: 1 << 20}})
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
			cmds := q.commands()
			stop, migrate := slices.Index(cmds, "stop"), slices.Index(cmds, "migrate")
			if stop < 0 || migrate < stop || slices.Index(cmds, "migrate-set-parameters") > migrate {
				t.Fatalf("want bandwidth raised, then stop, then migrate; got %v", cmds)
			}
			if q.bw != 128<<20 {
				t.Fatalf("max-bandwidth left at %d, want it put back", q.bw)
			}
			// The tag names the stored manifest, and the stream reads back.
			tagged := openLayout(t, "oci:"+dir+":vm")
			desc, err := tagged.Resolve(context.Background())
			if err != nil || desc.Digest != res.Manifest.Digest {
				t.Fatalf("tag resolves to %v, %v", desc.Digest, err)
			}
			_, m, cfg, err := LoadConfig(context.Background(), tagged)
			if err != nil || cfg.Mode != tc.mode {
				t.Fatalf("LoadConfig: %+v, %v", cfg, err)
			}
			var out bytes.Buffer
			if _, err := DecodeStream(context.Background(), m.Layers, tagged, &out, StreamOptions{}); err != nil || !bytes.Equal(out.Bytes(), state) {
				t.Fatalf("stored stream differs from QEMU's (%v)", err)
			}
		})
	}
}

// A failed checkpoint continues the VM and leaves no tag, in every mode.
func TestCheckpointFailureContinuesVMAndLeavesNoTag(t *testing.T) {
	for _, mode := range []Mode{ModePause, ModeSnapshot} {
		t.Run(string(mode), func(t *testing.T) {
			q := newFakeQEMU(t, "running", testStream(t, 2<<20))
			q.failMigrate = 100 << 10
			dir := t.TempDir()
			_, err := Checkpoint(context.Background(), q.dial(t), openLayout(t, "oci:"+dir+":vm"), CheckpointOptions{Mode: mode})
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
	q := newFakeQEMU(t, "running", testStream(t, 2<<20))
	dir := t.TempDir()
	// A file where the layout directory should be: every blob write fails.
	blocked := filepath.Join(dir, "layout")
	if err := os.WriteFile(blocked, []byte("not a directory"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := Checkpoint(context.Background(), q.dial(t), openLayout(t, "oci:"+blocked+":vm"), CheckpointOptions{Mode: ModePause})
	if err == nil {
		t.Fatal("checkpoint into an unwritable store succeeded")
	}
	if q.Status() != "running" {
		t.Fatalf("VM is %s after a failed pause-mode checkpoint, want running", q.Status())
	}
}

func TestCheckpointHookFailureContinuesVM(t *testing.T) {
	q := newFakeQEMU(t, "running", testStream(t, 1<<20))
	dir := t.TempDir()
	hookErr := errcode.New(errcode.InvalidInput, "bad overlay")
	_, err := Checkpoint(context.Background(), q.dial(t), openLayout(t, "oci:"+dir+":vm"), CheckpointOptions{
		Mode:         ModePause,
		WhileStopped: func(context.Context) (map[string]string, error) { return nil, hookErr },
	})
	if err != hookErr {
		t.Fatalf("err = %v, want the hook's", err)
	}
	if q.Status() != "running" {
		t.Fatalf("VM is %s, want running", q.Status())
	}
}

func TestCheckpointRefusesIncomingQEMU(t *testing.T) {
	q := newFakeQEMU(t, "inmigrate", nil)
	_, err := Checkpoint(context.Background(), q.dial(t), openLayout(t, "oci:"+t.TempDir()), CheckpointOptions{})
	if errcode.Of(err) != errcode.InvalidInput {
		t.Fatalf("err = %v, want INVALID_INPUT", err)
	}
}

func TestLiveModeRefusesDiskHook(t *testing.T) {
	q := newFakeQEMU(t, "running", nil)
	_, err := Checkpoint(context.Background(), q.dial(t), openLayout(t, "oci:"+t.TempDir()), CheckpointOptions{
		Mode: ModeLive, WhileStopped: func(context.Context) (map[string]string, error) { return nil, nil },
	})
	if errcode.Of(err) != errcode.Usage || slices.Contains(q.commands(), "migrate") {
		t.Fatalf("err = %v, commands %v; want USAGE before any migration", err, q.commands())
	}
}

// checkpointInto stores state as an image and returns its pinned reference.
func checkpointInto(t *testing.T, dir string, state []byte) ociimage.Reference {
	t.Helper()
	src := newFakeQEMU(t, "running", state)
	res, err := Checkpoint(context.Background(), src.dial(t), openLayout(t, "oci:"+dir+":vm"), CheckpointOptions{Mode: ModePause, Stream: StreamOptions{ChunkSize: 512 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	return res.Image
}

func TestRestoreLoadsExactStateAndContinues(t *testing.T) {
	for _, paused := range []bool{false, true} {
		state := testStream(t, 3<<20)
		dir := t.TempDir()
		ref := checkpointInto(t, dir, state)
		dst := newFakeQEMU(t, "inmigrate", state)
		res, err := Restore(context.Background(), dst.dial(t), openLayout(t, ref.String()), RestoreOptions{Paused: paused})
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(dst.received, state) || res.RawBytes != int64(len(state)) {
			t.Fatalf("target received %d bytes, want the %d captured", len(dst.received), len(state))
		}
		if want := map[bool]string{false: "running", true: "paused"}[paused]; dst.Status() != want {
			t.Fatalf("paused=%v: target is %s, want %s", paused, dst.Status(), want)
		}
		if !dst.caps["events"] {
			t.Fatal("restore did not turn on MIGRATION events on the target")
		}
	}
}

func TestRestoreRefusesMismatchBeforeSendingAByte(t *testing.T) {
	dir := t.TempDir()
	ref := checkpointInto(t, dir, testStream(t, 1<<20))
	dst := newFakeQEMU(t, "inmigrate", nil)
	dst.memory = 512 << 20
	_, err := Restore(context.Background(), dst.dial(t), openLayout(t, ref.String()), RestoreOptions{})
	if errcode.Of(err) != errcode.CompatMismatch {
		t.Fatalf("err = %v, want COMPAT_MISMATCH", err)
	}
	for _, c := range []string{"getfd", "migrate-incoming", "cont"} {
		if slices.Contains(dst.commands(), c) {
			t.Fatalf("target received %s after a mismatch: %v", c, dst.commands())
		}
	}
	if dst.Status() != "inmigrate" {
		t.Fatalf("target is %s, want still inmigrate", dst.Status())
	}
}

func TestRestoreCorruptFirstChunkNeverReachesQEMU(t *testing.T) {
	dir := t.TempDir()
	ref := checkpointInto(t, dir, testStream(t, 2<<20))
	repo := openLayout(t, ref.String())
	_, m, _, err := LoadConfig(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	flipByte(t, filepath.Join(dir, "blobs", "sha256", m.Layers[0].Digest.Encoded()))
	dst := newFakeQEMU(t, "inmigrate", nil)
	_, err = Restore(context.Background(), dst.dial(t), repo, RestoreOptions{})
	if errcode.Of(err) != errcode.DigestMismatch {
		t.Fatalf("err = %v, want DIGEST_MISMATCH", err)
	}
	if slices.Contains(dst.commands(), "migrate-incoming") || dst.Status() != "inmigrate" {
		t.Fatalf("QEMU saw the stream: %v, status %s", dst.commands(), dst.Status())
	}
}

func TestRestoreCorruptLaterChunkFailsTheLoad(t *testing.T) {
	dir := t.TempDir()
	state := testStream(t, 3<<20)
	ref := checkpointInto(t, dir, state)
	repo := openLayout(t, ref.String())
	_, m, _, err := LoadConfig(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	flipByte(t, filepath.Join(dir, "blobs", "sha256", m.Layers[len(m.Layers)-1].Digest.Encoded()))
	dst := newFakeQEMU(t, "inmigrate", state)
	_, err = Restore(context.Background(), dst.dial(t), repo, RestoreOptions{})
	if errcode.Of(err) != errcode.DigestMismatch {
		t.Fatalf("err = %v, want DIGEST_MISMATCH", err)
	}
	if slices.Contains(dst.commands(), "cont") || dst.Status() == "running" {
		t.Fatalf("the target runs after a corrupt restore: %v", dst.commands())
	}
	dst.done.Wait()
	if len(dst.received) >= len(state) {
		t.Fatalf("target received %d bytes: the corrupt chunk reached it", len(dst.received))
	}
}

func TestRestoreRefusesRunningQEMU(t *testing.T) {
	dir := t.TempDir()
	ref := checkpointInto(t, dir, testStream(t, 1<<20))
	dst := newFakeQEMU(t, "running", nil)
	_, err := Restore(context.Background(), dst.dial(t), openLayout(t, ref.String()), RestoreOptions{})
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
