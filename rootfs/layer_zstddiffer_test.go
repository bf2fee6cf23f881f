package rootfs

import (
	"context"
	"io"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/diff"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/pkg/labels"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	testcontainerd "github.com/vmsnap/vmsnap/internal/testing/containerd"
	"github.com/vmsnap/vmsnap/ociimage"
)

// zstdDiffer plays containerd 1.7's differ on containerd 1.6: asked for
// zstd, it stores a zstd layer labelled with its diff ID under the
// reference and labels it is given, as 1.7's walking differ does (here from
// a tar the real differ makes, compressed in this process). With noDiffID,
// the diff ID label is missing, as on content containerd already had.
type zstdDiffer struct {
	real     diff.Comparer
	cs       content.Store
	noDiffID bool
	calls    int
}

func (z *zstdDiffer) Compare(ctx context.Context, lower, upper []mount.Mount, opts ...diff.Opt) (ocispec.Descriptor, error) {
	var cfg diff.Config
	for _, o := range opts {
		if err := o(&cfg); err != nil {
			return ocispec.Descriptor{}, err
		}
	}
	if cfg.MediaType != ocispec.MediaTypeImageLayerZstd {
		return z.real.Compare(ctx, lower, upper, opts...)
	}
	z.calls++
	tarDesc, err := z.real.Compare(ctx, lower, upper, diff.WithMediaType(ocispec.MediaTypeImageLayer))
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	defer z.cs.Delete(ctx, tarDesc.Digest)
	ra, err := z.cs.ReaderAt(ctx, tarDesc)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	defer ra.Close()
	cw, err := content.OpenWriter(ctx, z.cs, content.WithRef(cfg.Reference))
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	defer cw.Close()
	enc, err := zstd.NewWriter(cw)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	if _, err := io.Copy(enc, io.NewSectionReader(ra, 0, tarDesc.Size)); err != nil {
		return ocispec.Descriptor{}, err
	}
	if err := enc.Close(); err != nil {
		return ocispec.Descriptor{}, err
	}
	lbls := maps.Clone(cfg.Labels)
	if !z.noDiffID {
		lbls[labels.LabelUncompressed] = tarDesc.Digest.String()
	}
	if err := cw.Commit(ctx, 0, "", content.WithLabels(lbls)); err != nil {
		return ocispec.Descriptor{}, err
	}
	info, err := z.cs.Info(ctx, cw.Digest())
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	return ocispec.Descriptor{MediaType: cfg.MediaType, Digest: info.Digest, Size: info.Size}, nil
}

// TestCaptureLayerDifferZstd: where containerd's differ writes zstd
// (containerd 1.7 and later), its layer is the one pushed, with the diff ID
// it labelled (or, without the label, the one vmsnap computes); nothing is
// compressed twice; progress ends at the layer's size; nothing of the
// capture stays in containerd's content store.
func TestCaptureLayerDifferZstd(t *testing.T) {
	d := testcontainerd.Start(t)
	c := d.Create(t, testcontainerd.PodContainer{PodUID: testcontainerd.NewPodUID(), Args: []string{"/bin/busybox", "sh", "-c",
		"set -e; head -c 6000000 /dev/urandom > /data; echo written > /state; echo done > /run/vm/ready; exec sleep 3600"}})
	deadline := time.Now().Add(time.Minute)
	for _, err := os.Stat(filepath.Join(c.HostDir, "ready")); err != nil; _, err = os.Stat(filepath.Join(c.HostDir, "ready")) {
		if time.Now().After(deadline) {
			t.Fatal("the container did not start")
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Cleanup(func() { diffService = func(c *containerd.Client) diff.Comparer { return c.DiffService() } })
	for _, noDiffID := range []bool{false, true} {
		t.Run("noDiffID="+strconv.FormatBool(noDiffID), func(t *testing.T) {
			var zd *zstdDiffer
			diffService = func(c *containerd.Client) diff.Comparer {
				zd = &zstdDiffer{real: c.DiffService(), cs: c.ContentStore(), noDiffID: noDiffID}
				return zd
			}
			captureWithDiffer(t, d, c, func() *zstdDiffer { return zd })
		})
	}
}

// captureWithDiffer captures c's writable layer with the zstdDiffer of zd,
// and checks the result.
func captureWithDiffer(t *testing.T, d *testcontainerd.Daemon, c *testcontainerd.Container, zd func() *zstdDiffer) {
	t.Helper()
	dir := t.TempDir()
	repo, err := ociimage.Open(context.Background(), ociimage.Reference{Layout: dir})
	if err != nil {
		t.Fatal(err)
	}
	var progress []int64
	res, err := CaptureLayer(context.Background(), d.Client, testcontainerd.Namespace, c.ID, repo, LayerOptions{Progress: func(n int64) { progress = append(progress, n) }})
	if err != nil {
		d.Log(t)
		t.Fatal(err)
	}
	if zd() == nil {
		t.Fatal("CaptureLayer did not use diffService")
	}
	if zd().calls != 1 || res.Durations.Compress != 0 || res.Layer.MediaType != ocispec.MediaTypeImageLayerZstd {
		t.Errorf("differ asked for zstd %d times, vmsnap compressed for %v, layer %s: want containerd's zstd layer", zd().calls, res.Durations.Compress, res.Layer.MediaType)
	}
	blob, err := os.ReadFile(filepath.Join(dir, "blobs", "sha256", res.Layer.Digest.Encoded()))
	if err != nil {
		t.Fatal(err)
	}
	if raw := decompress(t, res.Layer.MediaType, blob); digest.FromBytes(raw) != res.DiffID {
		t.Errorf("the layer decompresses to %s, the result says diff ID %s", digest.FromBytes(raw), res.DiffID)
	}
	if len(progress) == 0 || progress[len(progress)-1] != res.Layer.Size {
		t.Errorf("progress %v, want calls ending at %d", progress, res.Layer.Size)
	}
	for i := 1; i < len(progress); i++ {
		if progress[i] <= progress[i-1] {
			t.Errorf("progress not increasing: %v", progress)
		}
	}
	ctx := d.Context(context.Background())
	if _, err := d.Client.ContentStore().Info(ctx, res.Layer.Digest); err == nil {
		t.Errorf("the layer %s is still in containerd's content store", res.Layer.Digest)
	}
	if st, err := d.Client.ContentStore().ListStatuses(ctx); err != nil || len(st) > 0 {
		t.Errorf("ingests left: %v (%v)", st, err)
	}
}
