package ramfile

import (
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/ociimage"
)

// stateImage stores a manifest whose non-RAM layers are chunks of the given
// sizes (random bytes: what compressed blobs look like) and returns it
// pinned.
func stateImage(t *testing.T, repo ociimage.Repository, note string, sizes ...int) (ociimage.Repository, ocispec.Descriptor) {
	t.Helper()
	put := func(mt string, b []byte) ocispec.Descriptor {
		d := ocispec.Descriptor{MediaType: mt, Digest: digest.FromBytes(b), Size: int64(len(b))}
		if err := repo.PutBlob(context.Background(), d, b); err != nil {
			t.Fatal(err)
		}
		return d
	}
	rng := rand.NewChaCha8([32]byte{byte(len(note))})
	m := ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest, ArtifactType: ociimage.ArtifactTypeVMState,
		Config: put(ociimage.MediaTypeVMStateConfig, []byte(`{"note":"`+note+`"}`))}
	for _, n := range sizes {
		b := make([]byte, n)
		rng.Read(b)
		m.Layers = append(m.Layers, put(ociimage.MediaTypeChunk, b))
	}
	desc, err := repo.PutManifest(context.Background(), m)
	if err != nil {
		t.Fatal(err)
	}
	return ociimage.Pinned(repo, desc), desc
}

// A chunk's compressed size is whatever its writer says (its raw size,
// which the config's bound checks, can be 1 byte), so a tenant can push an
// image whose "device state" is gigabytes, and then any number of
// manifests that list the same blobs: each prepare kept a copy of them
// beside its RAM file, in the node's state directory. Kept state is
// bounded per image.
func TestKeepStateRefusesAnOversizedState(t *testing.T) {
	ctx := context.Background()
	c := Cache{Dir: filepath.Join(t.TempDir(), "cache")}
	if err := c.open(); err != nil {
		t.Fatal(err)
	}
	src, desc := stateImage(t, layout(t), "big", 40<<20, 40<<20)
	_ = c.KeepState(ctx, src, desc)
	if n := c.stateBytes(desc.Digest); n > maxKeptState {
		t.Fatalf("kept %d MiB of device state for one image, more than %d MiB", n>>20, maxKeptState>>20)
	}
	h, err := c.Hold()
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if h.State(desc.Digest, src.Reference()) != nil {
		t.Fatal("an oversized state was kept (a restore should read it from the store)")
	}
}

// The cache's bound (Evict's maxBytes, the agent's --ram-cache-max-bytes)
// counts the device state kept beside each RAM file: a RAM file of zero
// pages allocates nothing, so without it a tenant's prepares of such images
// filled the disk with their states while the cache counted 0 bytes.
func TestEvictCountsTheKeptState(t *testing.T) {
	ctx := context.Background()
	c := Cache{Dir: filepath.Join(t.TempDir(), "cache")}
	const size = 4 << 20
	src, desc := stateImage(t, layout(t), "sparse", 2<<20)
	// A RAM file of zeros: sparse, no block allocated.
	if _, _, err := c.Fill(ctx, desc.Digest, size, func(*os.File) (int64, error) { return 0, nil }); err != nil {
		t.Fatal(err)
	}
	if err := c.KeepState(ctx, src, desc); err != nil {
		t.Fatal(err)
	}
	removed, err := c.Evict(1<<20, 0, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(removed) != 1 {
		t.Fatalf("a cache of a sparse RAM file and 2 MiB of kept state, bounded at 1 MiB: evicted %v, want that entry", removed)
	}
	if _, err := os.Lstat(filepath.Join(c.Dir, stateName(desc.Digest))); !os.IsNotExist(err) {
		t.Fatalf("the evicted entry's state is still there (%v)", err)
	}
}
