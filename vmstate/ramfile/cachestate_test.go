package ramfile

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/ociimage"
)

// smallImage stores a manifest of a config and one chunk in repo and
// returns it pinned.
func smallImage(t *testing.T, repo ociimage.Repository, note string) (ociimage.Repository, ocispec.Descriptor) {
	t.Helper()
	put := func(mt string, b []byte) ocispec.Descriptor {
		d := ocispec.Descriptor{MediaType: mt, Digest: digest.FromBytes(b), Size: int64(len(b))}
		if err := repo.PutBlob(context.Background(), d, b); err != nil {
			t.Fatal(err)
		}
		return d
	}
	m := ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest, ArtifactType: ociimage.ArtifactTypeVMState,
		Config: put(ociimage.MediaTypeVMStateConfig, []byte(`{"note":"`+note+`"}`)),
		Layers: []ocispec.Descriptor{put(ociimage.MediaTypeChunk, []byte("device state of "+note))}}
	desc, err := repo.PutManifest(context.Background(), m)
	if err != nil {
		t.Fatal(err)
	}
	return ociimage.Pinned(repo, desc), desc
}

// The device state kept beside a RAM file is found by the image's digest,
// beneath the cache's handle, for the repositories it was fetched from
// only; what is not a directory or regular file of the cache's own (a
// link, a FIFO) is not found at all.
func TestHeldFindsStateByDigestBeneathTheCache(t *testing.T) {
	ctx := context.Background()
	c := Cache{Dir: filepath.Join(t.TempDir(), "cache")}
	if h, err := c.Hold(); h != nil || err != nil {
		t.Fatalf("a cache that is not there: %v, %v; want nothing, no error", h, err)
	}
	if err := c.open(); err != nil {
		t.Fatal(err)
	}
	src, desc := smallImage(t, layout(t), "a")
	if err := c.KeepState(ctx, src, desc); err != nil {
		t.Fatal(err)
	}
	other := layout(t)
	if _, err := ociimage.Copy(ctx, src, other, 0, 1); err != nil {
		t.Fatal(err)
	}
	h, err := c.Hold()
	if err != nil || h == nil {
		t.Fatalf("Hold: %v", err)
	}
	defer h.Close()
	local := h.State(desc.Digest, src.Reference())
	if local == nil {
		t.Fatal("the state kept from src is not found for src")
	}
	if m, err := local.Manifest(ctx, desc); err != nil || len(m.Layers) != 1 {
		t.Fatalf("the kept manifest: %v", err)
	}
	if h.State(desc.Digest, other.Reference()) != nil {
		t.Fatal("the state kept from src serves another repository")
	}
	if err := c.KeepState(ctx, ociimage.Pinned(other, desc), desc); err != nil {
		t.Fatal(err)
	}
	if h.State(desc.Digest, other.Reference()) == nil || h.State(desc.Digest, src.Reference()) == nil {
		t.Fatal("a second source is not recorded beside the first")
	}

	state := filepath.Join(c.Dir, stateName(desc.Digest))
	sources := filepath.Join(state, sourcesFile)
	ram := c.Path(desc.Digest)
	otherState := filepath.Join(t.TempDir(), "state")
	if err := os.Rename(state, otherState); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		plant func() error
	}{
		{"the state a link to another directory", func() error { return os.Symlink(otherState, state) }},
		{"its sources a FIFO", func() error {
			os.Remove(state)
			if err := os.Mkdir(state, 0o700); err != nil {
				return err
			}
			return unix.Mkfifo(sources, 0o600)
		}},
		{"its sources a link", func() error {
			os.Remove(sources)
			return os.Symlink(filepath.Join(otherState, sourcesFile), sources)
		}},
	} {
		if err := tc.plant(); err != nil {
			t.Fatal(err)
		}
		if h.State(desc.Digest, src.Reference()) != nil {
			t.Errorf("%s: found", tc.name)
		}
	}

	const size = 1 << 20
	elsewhere := filepath.Join(t.TempDir(), "ram") // of the right size, not the cache's
	if err := os.WriteFile(elsewhere, make([]byte, size), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		plant func() error
	}{
		{"a link", func() error { return os.Symlink(elsewhere, ram) }},
		{"a FIFO", func() error { os.Remove(ram); return unix.Mkfifo(ram, 0o600) }},
		{"the wrong size", func() error { os.Remove(ram); return os.WriteFile(ram, make([]byte, size/2), 0o600) }},
	} {
		if err := tc.plant(); err != nil {
			t.Fatal(err)
		}
		if h.File(desc.Digest, size) != nil {
			t.Errorf("a RAM file that is %s: found", tc.name)
		}
	}
	os.Remove(ram)
	if err := os.WriteFile(ram, make([]byte, size), 0o600); err != nil {
		t.Fatal(err)
	}
	if h.File(desc.Digest, size) == nil {
		t.Error("the RAM file is not found")
	}
}

// A cache directory others may write is not read at all.
func TestHoldRefusesAnUnsafeCache(t *testing.T) {
	c := Cache{Dir: filepath.Join(t.TempDir(), "cache")}
	if err := c.open(); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(c.Dir, 0o777); err != nil {
		t.Fatal(err)
	}
	if h, err := c.Hold(); h != nil || err == nil {
		t.Fatalf("a world-writable cache: %v, %v; want refused", h, err)
	}
}
