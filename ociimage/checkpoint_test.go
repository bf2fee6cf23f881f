package ociimage

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/remote"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/ocischema"
)

// twoParts stores a VM state and a disk image in repo, untagged.
func twoParts(t testing.TB, repo Repository) (state, disk ocispec.Descriptor) {
	t.Helper()
	descs, datas := testChunks(t, 2, 1<<10)
	putChunks(t, repo, descs, datas)
	var err error
	state, err = PushArtifact(t.Context(), repo, Artifact{ArtifactType: ArtifactTypeVMState, ConfigMediaType: MediaTypeVMStateConfig,
		Config: regConfig{Name: "state"}, Layers: descs[:1]})
	if err != nil {
		t.Fatal(err)
	}
	disk, err = PushArtifact(t.Context(), repo, Artifact{ArtifactType: ArtifactTypeDisk, ConfigMediaType: MediaTypeDiskConfig,
		Config: regConfig{Name: "disk"}, Layers: descs[1:]})
	if err != nil {
		t.Fatal(err)
	}
	return state, disk
}

// rawIndex fetches an index's bytes as stored, through Blob's checks.
func rawIndex(t *testing.T, repo Repository, desc ocispec.Descriptor) map[string]any {
	t.Helper()
	var b []byte
	var err error
	switch r := Underlying(repo).(type) {
	case *Layout:
		b, err = r.readBlob(t.Context(), "index", desc, MaxManifestSize)
	case *Registry:
		b, err = r.fetch(t.Context(), "index", desc, MaxManifestSize)
	}
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	return doc
}

// TestCheckpointIndexRoundTrip, in a layout and a registry: the index lists
// the parts in order, each marked with its part, with nothing a copy tool
// would rewrite (no artifactType, no platform); the tag names it, and
// OpenPart takes each part from it by tag or digest; what the checkpoint
// lacks is INVALID_INPUT; a reference to a manifest is that manifest. The
// index passes the image spec's schema.
func TestCheckpointIndexRoundTrip(t *testing.T) {
	t.Run("layout", func(t *testing.T) {
		dir := t.TempDir()
		checkIndexRoundTrip(t, openLayout(t, "oci:"+dir+":vm"), nil)
		if checked, err := ocischema.Layout(t.Context(), dir); err != nil || checked[ocispec.MediaTypeImageIndex] != 1 || checked[ocispec.MediaTypeImageManifest] != 2 {
			t.Fatalf("schemas: %v, %v", checked, err)
		}
	})
	t.Run("registry", func(t *testing.T) {
		f := newFakeRegistry(t)
		opts := []Option{WithCAFile(f.caFile)}
		checkIndexRoundTrip(t, f.open(t, "vms/vm1:vm"), opts)
		checked, err := ocischema.RegistryTag(t.Context(), f.host+"/vms/vm1", ":vm", remote.WithTransport(f.srv.Client().Transport))
		if err != nil || checked[ocispec.MediaTypeImageIndex] != 1 || checked[ocispec.MediaTypeImageManifest] != 2 {
			t.Fatalf("schemas: %v, %v", checked, err)
		}
	})
}

func checkIndexRoundTrip(t *testing.T, repo Repository, opts []Option) {
	ctx := t.Context()
	state, disk := twoParts(t, repo)
	idx, err := PutCheckpoint(ctx, repo, CheckpointIndex{
		Parts:       map[string]ocispec.Descriptor{PartDisk: disk, PartVMState: state},
		Annotations: map[string]string{AnnotationCreated: "2026-01-02T03:04:05Z"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := TagManifest(ctx, repo, idx, "vm"); err != nil {
		t.Fatal(err)
	}
	doc := rawIndex(t, repo, idx)
	entries, _ := doc["manifests"].([]any)
	if _, ok := doc["artifactType"]; ok || len(entries) != 2 {
		t.Fatalf("index %v", doc)
	}
	for i, want := range []struct {
		part string
		desc ocispec.Descriptor
	}{{PartVMState, state}, {PartDisk, disk}} {
		e := entries[i].(map[string]any)
		a, _ := e["annotations"].(map[string]any)
		if e["digest"] != want.desc.Digest.String() || a[AnnotationPart] != want.part || e["artifactType"] != nil || e["platform"] != nil {
			t.Fatalf("entry %d is %v, want the %s part %s and nothing a copy tool would rewrite", i, e, want.part, want.desc.Digest)
		}
	}
	if doc["annotations"].(map[string]any)[AnnotationCheckpoint] != ArtifactTypeCheckpoint {
		t.Fatalf("the index is not marked as a checkpoint: %v", doc["annotations"])
	}

	tagged := repo.Reference().WithTag("vm")
	for _, c := range []struct {
		ref  Reference
		part string
		want ocispec.Descriptor
	}{
		{tagged, PartVMState, state}, {tagged, PartDisk, disk},
		{tagged.WithDigest(idx.Digest), PartDisk, disk},
		{tagged.WithDigest(state.Digest), PartDisk, state}, // a manifest is itself, whatever the part
	} {
		p, cp, err := OpenPart(ctx, c.ref, c.part, opts...)
		if err != nil {
			t.Fatalf("%s %s: %v", c.ref, c.part, err)
		}
		got, _ := p.Resolve(ctx)
		if got.Digest != c.want.Digest || p.Reference() != c.ref.WithDigest(c.want.Digest) {
			t.Fatalf("%s %s opened %s (%s), want %s", c.ref, c.part, got.Digest, p.Reference(), c.want.Digest)
		}
		if (cp == nil) != (c.ref.Digest == state.Digest) || cp != nil && cp.Ref.Digest != idx.Digest {
			t.Fatalf("%s: checkpoint %+v", c.ref, cp)
		}
	}
	_, _, err = OpenPart(ctx, tagged, PartRootfs, opts...)
	wantCode(t, err, errcode.InvalidInput, "has no rootfs image")
	if got, err := StateManifest(ctx, repo, idx); err != nil || got.Digest != state.Digest {
		t.Fatalf("StateManifest: %v, %v", got.Digest, err)
	}
}

// PutIndex refuses an index over a manifest the store does not hold, and
// stores nothing.
func TestPutIndexRefusesMissingManifests(t *testing.T) {
	missing := blobDesc(ocispec.MediaTypeImageManifest, []byte(`{"schemaVersion":2}`))
	idx := ocispec.Index{Manifests: []ocispec.Descriptor{missing}}
	t.Run("layout", func(t *testing.T) {
		repo := openLayout(t, "oci:"+t.TempDir())
		twoParts(t, repo)
		_, err := repo.PutIndex(t.Context(), idx)
		wantCode(t, err, errcode.RegistryError, "a manifest it lists is not stored whole")
		if n := len(strictIndex(t, repo.dir).Manifests); n != 2 {
			t.Fatalf("index.json lists %d manifests, want the 2 parts", n)
		}
	})
	t.Run("registry", func(t *testing.T) {
		f := newFakeRegistry(t)
		repo := f.open(t, "vms/vm1")
		_, err := repo.PutIndex(t.Context(), idx)
		wantCode(t, err, errcode.RegistryError, "a manifest it lists is not in")
		if f.count("PUT", "/manifests/") != 0 {
			t.Fatal("the index was put")
		}
	})
}

// ReadCheckpoint refuses an index that is not a well-formed checkpoint:
// what it reads from a registry or a layout is anyone's. An index without
// the marker is no checkpoint at all (ErrNotCheckpoint).
func TestReadCheckpointRefusesHostileIndexes(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	repo := openLayout(t, "oci:"+dir)
	state, disk := twoParts(t, repo)
	entry := func(d ocispec.Descriptor, part string) ocispec.Descriptor {
		return ocispec.Descriptor{MediaType: d.MediaType, Digest: d.Digest, Size: d.Size, Annotations: map[string]string{AnnotationPart: part}}
	}
	marked := func(more ...string) map[string]string {
		a := map[string]string{AnnotationCheckpoint: ArtifactTypeCheckpoint}
		for i := 0; i+1 < len(more); i += 2 {
			a[more[i]] = more[i+1]
		}
		return a
	}
	inner, err := repo.PutIndex(ctx, ocispec.Index{Manifests: []ocispec.Descriptor{entry(state, PartVMState)}, Annotations: marked()})
	if err != nil {
		t.Fatal(err)
	}
	many := []ocispec.Descriptor{entry(state, PartVMState)}
	for range MaxCheckpointParts {
		many = append(many, entry(disk, PartDisk))
	}
	link := func(d ocispec.Descriptor, path string) string { return path + "@" + d.Digest.String() }
	for name, c := range map[string]struct {
		idx  ocispec.Index
		want string
	}{
		"no marker":         {ocispec.Index{Manifests: []ocispec.Descriptor{entry(state, PartVMState)}}, "not a vmsnap checkpoint"},
		"unknown part":      {ocispec.Index{Manifests: []ocispec.Descriptor{entry(state, PartVMState), entry(disk, "kernel")}, Annotations: marked()}, `part "kernel"`},
		"two states":        {ocispec.Index{Manifests: []ocispec.Descriptor{entry(state, PartVMState), entry(disk, PartVMState)}, Annotations: marked()}, "two vmstate parts"},
		"no state":          {ocispec.Index{Manifests: []ocispec.Descriptor{entry(disk, PartDisk)}, Annotations: marked()}, "no VM state image"},
		"a nested index":    {ocispec.Index{Manifests: []ocispec.Descriptor{entry(state, PartVMState), entry(inner, PartDisk)}, Annotations: marked()}, "not a part vmsnap knows"},
		"too many":          {ocispec.Index{Manifests: many, Annotations: marked()}, "more than a checkpoint has"},
		"listed and linked": {ocispec.Index{Manifests: []ocispec.Descriptor{entry(state, PartVMState), entry(disk, PartDisk)}, Annotations: marked(AnnotationDiskLink, link(disk, "other"))}, "two disk parts"},
		"a link up":         {ocispec.Index{Manifests: []ocispec.Descriptor{entry(state, PartVMState)}, Annotations: marked(AnnotationDiskLink, link(disk, ".."))}, "does not name a directory beside"},
		"a link down":       {ocispec.Index{Manifests: []ocispec.Descriptor{entry(state, PartVMState)}, Annotations: marked(AnnotationRootfsLink, link(disk, "a/b"))}, "does not name a directory beside"},
		"a link by host":    {ocispec.Index{Manifests: []ocispec.Descriptor{entry(state, PartVMState)}, Annotations: marked(AnnotationDiskLink, "oci:/etc@"+disk.Digest.String())}, "does not name a directory beside"},
	} {
		t.Run(name, func(t *testing.T) {
			desc, err := repo.PutIndex(ctx, c.idx)
			if err != nil {
				t.Fatal(err)
			}
			_, err = ReadCheckpoint(ctx, repo, desc)
			wantCode(t, err, errcode.InvalidInput, c.want)
			if errors.Is(err, ErrNotCheckpoint) != (name == "no marker") {
				t.Fatalf("ErrNotCheckpoint: %v", err)
			}
			if _, _, err := OpenPart(ctx, Reference{Layout: dir, Digest: desc.Digest}, PartVMState); errcode.Of(err) != errcode.InvalidInput {
				t.Fatalf("OpenPart: %v", err)
			}
		})
	}
	// A manifest that is not a VM state image is no checkpoint either.
	_, err = ReadCheckpoint(ctx, repo, disk)
	if !errors.Is(err, ErrNotCheckpoint) || !strings.Contains(err.Error(), "is a disk image, not a checkpoint") {
		t.Fatalf("a disk image read as a checkpoint: %v", err)
	}
}

// A checkpoint in a registry that links its disk by a host, or by a path
// that is no repository of the registry it is read from, is refused before
// anything is fetched from there.
func TestReadCheckpointRefusesLinksOffTheRegistry(t *testing.T) {
	ctx := context.Background()
	f := newFakeRegistry(t)
	repo := f.open(t, "vms/vm1")
	state, disk := twoParts(t, repo)
	for _, bad := range []string{"127.0.0.1:1/vms/disk", "Vms/Disk", "vms/../disk", "vms/disk:tag", "/vms/disk", ""} {
		desc, err := repo.PutIndex(ctx, ocispec.Index{
			Manifests:   []ocispec.Descriptor{{MediaType: state.MediaType, Digest: state.Digest, Size: state.Size, Annotations: map[string]string{AnnotationPart: PartVMState}}},
			Annotations: map[string]string{AnnotationCheckpoint: ArtifactTypeCheckpoint, AnnotationDiskLink: bad + "@" + disk.Digest.String()},
		})
		if err != nil {
			t.Fatal(err)
		}
		f.resetLog()
		_, _, err = OpenPart(ctx, repo.Reference().WithDigest(desc.Digest), PartDisk, WithCAFile(f.caFile))
		if errcode.Of(err) != errcode.InvalidInput {
			t.Fatalf("link %q: %v, want INVALID_INPUT", bad, err)
		}
		for _, r := range f.requests() {
			if !strings.Contains(r, "/vms/vm1/") && r != "GET /v2/" {
				t.Fatalf("link %q: the reader asked %s", bad, r)
			}
		}
	}
}

// A checkpoint whose disk rides in its rootfs image says so when asked for
// its disk image.
func TestOpenPartSaysWhereADiskInTheRootfsIs(t *testing.T) {
	dir := t.TempDir()
	repo := openLayout(t, "oci:"+dir)
	state, _ := twoParts(t, repo)
	idx, err := PutCheckpoint(t.Context(), repo, CheckpointIndex{Parts: map[string]ocispec.Descriptor{PartVMState: state},
		Annotations: map[string]string{AnnotationDiskRootfsPath: "/vm/disk/overlay.qcow2"}})
	if err != nil {
		t.Fatal(err)
	}
	_, _, err = OpenPart(t.Context(), Reference{Layout: dir, Digest: idx.Digest}, PartDisk)
	wantCode(t, err, errcode.InvalidInput, "its disk overlay is in its rootfs image, at /vm/disk/overlay.qcow2")
}
