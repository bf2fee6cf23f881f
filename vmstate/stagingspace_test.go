package vmstate

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// fakeFree makes freeSpace report free bytes for the test.
func fakeFree(t *testing.T, free int64) {
	old := freeSpace
	freeSpace = func(string) (int64, error) { return free, nil }
	t.Cleanup(func() { freeSpace = old })
}

// forgeDataBytes stores, beside the image ref names in its layout, a copy
// whose config declares dataBytes, and returns it pinned: an image may say
// what it likes about its sizes.
func forgeDataBytes(t *testing.T, dir, ref string, dataBytes int64) string {
	t.Helper()
	ctx := context.Background()
	repo := openLayout(t, ref)
	desc, err := repo.Resolve(ctx)
	if err != nil {
		t.Fatal(err)
	}
	m, err := repo.Manifest(ctx, desc)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := repo.Blob(ctx, m.Config, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["dataBytes"] = dataBytes
	raw, _ = json.Marshal(cfg)
	m.Config = ocispec.Descriptor{MediaType: m.Config.MediaType, Digest: digest.FromBytes(raw), Size: int64(len(raw))}
	dst := openLayout(t, "oci:"+dir+":forged")
	if err := dst.PutBlob(ctx, m.Config, raw); err != nil {
		t.Fatal(err)
	}
	forged, err := dst.PutManifest(ctx, m)
	if err != nil {
		t.Fatal(err)
	}
	return "oci:" + dir + "@" + forged.Digest.String()
}

// Every staging file of a VM is planned with one bound, maxStateBytes of
// its memory: the free-space checks before a mapped-ram checkpoint, a
// memory-file capture and a mapped-ram restore all ask for that much, the
// most the file's guard lets it hold. Whatever the image declares.
func TestStagingFreeSpaceIsCheckedAgainstTheBound(t *testing.T) {
	state := mappedState(t, 4<<20)
	const memory = 256 << 20 // the fakes'
	bound := maxStateBytes(memory)

	t.Run("mapped-ram checkpoint", func(t *testing.T) {
		for _, free := range []int64{bound - 1, bound} {
			fakeFree(t, free)
			q := mappedSource(t, state)
			_, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"),
				CheckpointOptions{Mode: ModeSnapshot, Format: FormatMappedRAM, StagingDir: t.TempDir()})
			if ok := free >= bound; (err == nil) != ok || (!ok && (errcode.Of(err) != errcode.Internal || slices.Contains(q.Commands(), "stop"))) {
				t.Fatalf("%d MiB free for a bound of %d MiB: %v (commands %v)", free>>20, bound>>20, err, q.Commands())
			}
		}
	})
	t.Run("memory-file checkpoint", func(t *testing.T) {
		fakeFree(t, maxStateBytes(fakeRAM)-1)
		q, _ := fakeFileVM(t)
		res, err := Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"), CheckpointOptions{Mode: ModePause, StagingDir: t.TempDir()})
		if err != nil || res.Config.Format == FormatMemoryFile {
			t.Fatalf("auto without room to stage the RAM: %v, format %q; want the stream", err, res.Config.Format)
		}
		q, _ = fakeFileVM(t)
		_, err = Checkpoint(context.Background(), q.Dial(t), openLayout(t, "oci:"+t.TempDir()+":vm"), CheckpointOptions{Mode: ModePause, Format: FormatMemoryFile, StagingDir: t.TempDir()})
		if errcode.Of(err) != errcode.Internal || slices.Contains(q.Commands(), "stop") {
			t.Fatalf("memory-file without room to stage the RAM: %v; want INTERNAL before the VM is stopped", err)
		}
	})
	t.Run("mapped-ram restore, data declared small", func(t *testing.T) {
		dir, ref := checkpointMappedInto(t, state)
		forged := forgeDataBytes(t, dir, ref, 0)
		fakeFree(t, bound-1) // room for what it declares, not for what it writes
		dst := qmptest.NewFakeQEMU(t, "inmigrate", state)
		dst.EnableMappedRAM()
		_, err := Restore(context.Background(), dst.Dial(t), openLayout(t, forged), RestoreOptions{StagingDir: t.TempDir()})
		if errcode.Of(err) != errcode.Internal || !strings.Contains(err.Error(), "MiB free") || slices.Contains(dst.Commands(), "migrate-incoming") {
			t.Fatalf("a restore that would stage more than the free space: %v; want INTERNAL before the target is fed", err)
		}
	})
}

// The agent runs operations side by side: each reserves its bound on the
// staging filesystem until its file is gone, and the next one is checked
// against what is left.
func TestStagingReservationsAddUp(t *testing.T) {
	dir := t.TempDir()
	fakeFree(t, 3<<30)
	first, err := reserveStaging(dir, 2<<30, true, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := reserveStaging(dir, 2<<30, true, ""); errcode.Of(err) != errcode.Internal {
		t.Fatalf("a second reservation past the free space: %v, want INTERNAL", err)
	}
	first()
	first() // once only
	second, err := reserveStaging(dir, 2<<30, true, "")
	if err != nil {
		t.Fatalf("after the first was released: %v", err)
	}
	second()
	if _, err := reserveStaging(dir, 4<<30, true, ""); errcode.Of(err) != errcode.Internal {
		t.Fatal("a reservation larger than the free space was granted")
	}
}
