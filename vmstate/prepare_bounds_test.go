package vmstate

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

// declaringImage is a memory-file image of a few MiB of data (a fake VM's
// base) made to declare declared bytes of guest memory, as a delta (a
// chain of two, so that a prepare checks its map), whose page map says
// every page holds data: its page-map layers compress to a few KiB each.
// It returns the layout and the manifest.
func declaringImage(t *testing.T, declared int64) (string, ocispec.Descriptor) {
	t.Helper()
	ctx := context.Background()
	q, _ := fakeFileVM(t)
	dir := t.TempDir()
	base, err := Checkpoint(ctx, q.Dial(t), openLayout(t, "oci:"+dir+":vm"), CheckpointOptions{StagingDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	repo := openLayout(t, "oci:"+dir)
	_, m, cfg, err := LoadConfig(ctx, ociimage.Pinned(repo, base.Manifest))
	if err != nil {
		t.Fatal(err)
	}
	cfg.Record.MemoryBytes, cfg.RAM.Bytes = declared, declared
	cfg.RAM.Chain[0].Manifest = base.Manifest.Digest
	cfg.RAM.Chain = append(cfg.RAM.Chain, ChainLink{Created: cfg.Created})
	// A piece of the map: every page data (xxhash64 1).
	var entry [24]byte
	binary.LittleEndian.PutUint64(entry[:], 1)
	raw := bytes.Repeat(entry[:], 1<<20)
	enc, _ := zstd.NewWriter(nil)
	piece := enc.EncodeAll(raw, nil)
	pieceDesc := ocispec.Descriptor{MediaType: ociimage.MediaTypeRAMPageMap, Digest: digest.FromBytes(piece), Size: int64(len(piece))}
	if err := repo.PutBlob(ctx, pieceDesc, piece); err != nil {
		t.Fatal(err)
	}
	var layers []ocispec.Descriptor
	for _, l := range m.Layers {
		switch l.MediaType {
		case ociimage.MediaTypeRAMPageMap:
		case ociimage.MediaTypeRAMIndex:
			layers = append(layers, declaringIndex(t, repo, m, l, declared))
		default:
			layers = append(layers, l)
		}
	}
	var maps []ocispec.Descriptor
	for first := 0; first < ramfile.Pages(declared); first += 1 << 20 {
		d := pieceDesc
		d.Annotations = map[string]string{ociimage.AnnotationRAMFirstPage: strconv.Itoa(first), ociimage.AnnotationRawSize: strconv.Itoa(len(raw))}
		maps = append(maps, d)
	}
	m.Layers = append(maps, layers...)
	blob, _ := json.Marshal(cfg)
	m.Config = ocispec.Descriptor{MediaType: m.Config.MediaType, Digest: digest.FromBytes(blob), Size: int64(len(blob))}
	if err := repo.PutBlob(ctx, m.Config, blob); err != nil {
		t.Fatal(err)
	}
	desc, err := repo.PutManifest(ctx, m)
	if err != nil {
		t.Fatal(err)
	}
	return dir, desc
}

// declaringIndex is the image's index l made to declare a RAM file of
// declared bytes (the regions it lists are the base's).
func declaringIndex(t *testing.T, repo ociimage.Repository, m ocispec.Manifest, l ocispec.Descriptor, declared int64) ocispec.Descriptor {
	t.Helper()
	var ram []ocispec.Descriptor
	for _, l := range m.Layers {
		if ramfile.IsRAMLayer(l) {
			ram = append(ram, l)
		}
	}
	cfgBlob, err := repo.Blob(context.Background(), m.Config, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	var cfg Config
	if err := json.Unmarshal(cfgBlob, &cfg); err != nil {
		t.Fatal(err)
	}
	layers, err := ramfile.SplitLayers(ram, cfg.RAM.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	x, err := ramfile.LoadIndex(context.Background(), layers, repo, cfg.RAM.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	x.FileSize = declared
	enc, _ := zstd.NewWriter(nil)
	data := enc.EncodeAll(x.Encode(), nil)
	d := ocispec.Descriptor{MediaType: l.MediaType, Digest: digest.FromBytes(data), Size: int64(len(data))}
	if err := repo.PutBlob(context.Background(), d, data); err != nil {
		t.Fatal(err)
	}
	return d
}

// Issue 21, MEDIUM 6: a small image that declares 64 GiB of guest memory
// and a page map of data pages drove a prepare's heap to 911 MiB. What a
// prepare allocates is bounded by what the image stores plus a fixed
// amount: measured as the bytes it allocates, whatever it declares.
func TestPrepareMemoryIsBoundedByWhatTheImageStores(t *testing.T) {
	const declared = 64 << 30
	dir, desc := declaringImage(t, declared)
	repo := openLayout(t, "oci:"+dir+"@"+desc.Digest.String())
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, err := Prepare(context.Background(), repo, PrepareOptions{Cache: ramfile.Cache{Dir: t.TempDir() + "/cache"}})
	runtime.ReadMemStats(&after)
	// In the pack format the regions are checked against the index, not
	// the map (which only a next checkpoint's parent reads, and checks):
	// the prepare gives the base's pages in a file of the declared size.
	if err != nil {
		t.Fatalf("an image whose map says every page holds data: %v", err)
	}
	// The materializer's buffers (a region per worker), a bit per page of
	// the declared RAM (2 MiB), the decoders, the index: far below the
	// 384 MiB of entries the map declares.
	t.Logf("allocated %d KiB: %v", (after.TotalAlloc-before.TotalAlloc)>>10, err)
	if n := after.TotalAlloc - before.TotalAlloc; n > 64<<20 {
		t.Fatalf("the prepare allocated %d MiB for an image of a few MiB declaring %d GiB", n>>20, declared>>30)
	}
}

// countingRepo counts the RAM layers fetched through it.
type countingRepo struct {
	ociimage.Repository
	ramBlobs atomic.Int64
}

func (c *countingRepo) Blob(ctx context.Context, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	if ramfile.IsRAMLayer(desc) {
		c.ramBlobs.Add(1)
	}
	return c.Repository.Blob(ctx, desc, limit)
}

// A node's --max-guest-memory refuses an image that declares more, before
// a layer of it is fetched, with a code and the flag to raise.
func TestPrepareRefusesMoreGuestMemoryThanTheNodeTakes(t *testing.T) {
	dir, desc := declaringImage(t, 64<<30)
	repo := &countingRepo{Repository: openLayout(t, "oci:"+dir+"@"+desc.Digest.String())}
	_, err := Prepare(context.Background(), repo, PrepareOptions{Cache: ramfile.Cache{Dir: t.TempDir() + "/cache"}, MaxGuestMemory: 16 << 30})
	if errcode.Of(err) != errcode.InvalidInput || !strings.Contains(err.Error(), "maxGuestMemory") {
		t.Fatalf("got %v, want INVALID_INPUT naming maxGuestMemory", err)
	}
	if n := repo.ramBlobs.Load(); n != 0 {
		t.Fatalf("%d RAM layers were fetched before the image was refused", n)
	}
}
