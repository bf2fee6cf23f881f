package ociimage

import (
	"errors"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

type testConfig struct {
	Machine string `json:"machine"`
	Memory  int64  `json:"memory"`
}

func pushTestArtifact(t *testing.T, ref, artifactType, configType string, config any) (*Layout, ocispec.Descriptor) {
	t.Helper()
	repo := openLayout(t, ref)
	chunk := putBlob(t, repo, MediaTypeChunk, []byte("compressed chunk"))
	desc, err := pushTagged(t.Context(), repo, Artifact{
		ArtifactType:    artifactType,
		ConfigMediaType: configType,
		Config:          config,
		Layers:          []ocispec.Descriptor{chunk},
		Annotations:     map[string]string{AnnotationMode: "live"},
	})
	if err != nil {
		t.Fatal(err)
	}
	return repo, desc
}

func TestArtifactRoundTrip(t *testing.T) {
	ref := "oci:" + t.TempDir() + ":snap"
	_, pushed := pushTestArtifact(t, ref, ArtifactTypeVMState, MediaTypeVMStateConfig, testConfig{Machine: "pc-q35-9.2", Memory: 4 << 30})

	var cfg testConfig
	desc, m, err := PullArtifact(t.Context(), openLayout(t, ref), ArtifactTypeVMState, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	if desc.Digest != pushed.Digest || cfg != (testConfig{Machine: "pc-q35-9.2", Memory: 4 << 30}) {
		t.Fatalf("pulled %s %+v, pushed %s", desc.Digest, cfg, pushed.Digest)
	}
	if m.ArtifactType != ArtifactTypeVMState || m.Config.MediaType != MediaTypeVMStateConfig ||
		len(m.Layers) != 1 || m.Annotations[AnnotationMode] != "live" {
		t.Fatalf("manifest %+v", m)
	}
}

func TestPullArtifactWrongType(t *testing.T) {
	ref := "oci:" + t.TempDir() + ":disk"
	pushTestArtifact(t, ref, ArtifactTypeDisk, MediaTypeDiskConfig, testConfig{})
	var cfg testConfig
	_, _, err := PullArtifact(t.Context(), openLayout(t, ref), ArtifactTypeVMState, &cfg)
	wantCode(t, err, errcode.InvalidInput, ref+" is a disk image, not a VM state image")
}

func TestPullArtifactWrongConfigType(t *testing.T) {
	ref := "oci:" + t.TempDir() + ":disk"
	pushTestArtifact(t, ref, ArtifactTypeDisk, MediaTypeVMStateConfig, testConfig{})
	var cfg testConfig
	_, _, err := PullArtifact(t.Context(), openLayout(t, ref), ArtifactTypeDisk, &cfg)
	wantCode(t, err, errcode.InvalidInput, MediaTypeVMStateConfig)
}

func TestPullArtifactUnknownConfigField(t *testing.T) {
	ref := "oci:" + t.TempDir() + ":new"
	newer := map[string]any{"machine": "pc", "memory": 1, "cpuModel": "host"}
	pushTestArtifact(t, ref, ArtifactTypeVMState, MediaTypeVMStateConfig, newer)
	var cfg testConfig
	_, _, err := PullArtifact(t.Context(), openLayout(t, ref), ArtifactTypeVMState, &cfg)
	wantCode(t, err, errcode.InvalidInput, "cpuModel")
}

func TestArtifactRefusesForeignLayers(t *testing.T) {
	ctx := t.Context()
	for name, layer := range map[string]ocispec.Descriptor{
		"media type": {MediaType: ocispec.MediaTypeImageLayerGzip, Digest: digest.FromString("l"), Size: 1},
		"size":       {MediaType: MediaTypeChunk, Digest: digest.FromString("l"), Size: MaxChunkSize + 1},
	} {
		dir := t.TempDir()
		repo := openLayout(t, "oci:"+dir)
		_, err := pushTagged(ctx, repo, Artifact{ArtifactType: ArtifactTypeDisk, ConfigMediaType: MediaTypeDiskConfig,
			Config: testConfig{}, Layers: []ocispec.Descriptor{layer}})
		if errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("%s: PushArtifact = %v, want INVALID_INPUT", name, err)
		}

		// Another tool could write such a manifest; store it by hand.
		cfg := putBlob(t, repo, MediaTypeDiskConfig, []byte(`{}`))
		_, b, desc, err := encodeManifest(ocispec.Manifest{ArtifactType: ArtifactTypeDisk, Config: cfg, Layers: []ocispec.Descriptor{layer}})
		if err != nil {
			t.Fatal(err)
		}
		putBlob(t, repo, desc.MediaType, b)
		var out testConfig
		_, _, err = PullArtifact(ctx, openLayout(t, "oci:"+dir+"@"+desc.Digest.String()), ArtifactTypeDisk, &out)
		wantCode(t, err, errcode.InvalidInput, "layer 0")
	}
}

func TestPullArtifactMissingTag(t *testing.T) {
	ref := "oci:" + t.TempDir()
	pushTestArtifact(t, ref+":a", ArtifactTypeDisk, MediaTypeDiskConfig, testConfig{})
	var cfg testConfig
	_, _, err := PullArtifact(t.Context(), openLayout(t, ref+":b"), ArtifactTypeDisk, &cfg)
	wantCode(t, err, errcode.RegistryError, "no tag b")
}

// TagManifest moves a tag to a manifest stored by digest, in a layout: the
// previous manifest stays listed, and nothing is tagged before it is asked.
func TestLayoutTagManifest(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	tagged := openLayout(t, "oci:"+dir+":v1")
	old, err := putTagged(ctx, tagged, testManifest(t, tagged, "old", "a"))
	if err != nil {
		t.Fatal(err)
	}
	byDigest := openLayout(t, "oci:"+dir)
	d, err := putTagged(ctx, byDigest, testManifest(t, byDigest, "new", "b"))
	if err != nil {
		t.Fatal(err)
	}
	if r, err := tagged.Resolve(ctx); err != nil || r.Digest != old.Digest {
		t.Fatalf("a push by digest moved the tag: %v, %v", r.Digest, err)
	}
	if err := TagManifest(ctx, byDigest, d, "v1"); err != nil {
		t.Fatal(err)
	}
	if r, err := tagged.Resolve(ctx); err != nil || r.Digest != d.Digest || r.ArtifactType != ArtifactTypeDisk {
		t.Fatalf("v1 resolves to %+v, %v; want %s", r, err, d.Digest)
	}
	idx := strictIndex(t, dir)
	if len(idx.Manifests) != 2 || len(entriesTagged(idx, "v1")) != 1 {
		t.Fatalf("index after tagging: %+v", idx.Manifests)
	}
	// Idempotent, and a second tag on the same manifest is its own entry.
	if err := TagManifest(ctx, byDigest, d, "v1"); err != nil {
		t.Fatal(err)
	}
	if err := TagManifest(ctx, tagged, d, "latest"); err != nil {
		t.Fatal(err)
	}
	if idx := strictIndex(t, dir); len(idx.Manifests) != 3 || len(entriesTagged(idx, "latest")) != 1 {
		t.Fatalf("index after a second tag: %+v", idx.Manifests)
	}

	// A manifest the layout does not hold is never tagged.
	missing := blobDesc(ocispec.MediaTypeImageManifest, []byte(`{"schemaVersion":2}`))
	wantCode(t, TagManifest(ctx, byDigest, missing, "v2"), errcode.RegistryError, "missing")
	flipByte(t, dir, old.Digest)
	wantCode(t, TagManifest(ctx, byDigest, old, "v2"), errcode.DigestMismatch, "corrupt")
	wantCode(t, TagManifest(ctx, byDigest, d, "-bad"), errcode.InvalidInput, "invalid tag")
	wantCode(t, TagManifest(ctx, byDigest, ocispec.Descriptor{MediaType: ocispec.MediaTypeImageIndex, Digest: d.Digest, Size: d.Size}, "v2"),
		errcode.InvalidInput, "is not a application/vnd.oci.image.index.v1+json")
	wantCode(t, TagManifest(ctx, byDigest, ocispec.Descriptor{MediaType: "application/vnd.oci.image.config.v1+json", Digest: d.Digest, Size: d.Size}, "v2"),
		errcode.InvalidInput, "not an image manifest or index")
	if tags, _ := byDigest.Tags(ctx); len(tags) != 2 {
		t.Fatalf("tags after refused taggings: %v", tags)
	}
	wantCode(t, TagManifest(ctx, openLayout(t, "oci:"+t.TempDir()), d, "v1"), errcode.RegistryError, "no OCI layout")
}

// TagManifest in a registry: a manifest pushed by digest gets the tag only
// when asked, with the same bytes.
func TestRegistryTagManifest(t *testing.T) {
	ctx := t.Context()
	f := newFakeRegistry(t)
	repo := f.open(t, "vms/disk")
	descs, datas := testChunks(t, 2, 1<<10)
	putChunks(t, repo, descs, datas)
	d := pushDisk(t, repo, descs, nil)
	if _, err := f.open(t, "vms/disk:v1").Resolve(ctx); errcode.Of(err) != errcode.RegistryError {
		t.Fatalf("a push by digest made the tag: %v", err)
	}
	if err := TagManifest(ctx, repo, d, "v1"); err != nil {
		t.Fatal(err)
	}
	r, err := f.open(t, "vms/disk:v1").Resolve(ctx)
	if err != nil || r.Digest != d.Digest {
		t.Fatalf("v1 resolves to %v, %v; want %s", r.Digest, err, d.Digest)
	}
	missing := blobDesc(ocispec.MediaTypeImageManifest, []byte(`{"schemaVersion":2}`))
	wantCode(t, TagManifest(ctx, repo, missing, "v2"), errcode.RegistryError, "missing")
	if _, err := f.open(t, "vms/disk:v2").Resolve(ctx); err == nil {
		t.Fatal("a missing manifest was tagged")
	}
}

// ResolveTag reads any tag through a repository opened without one, as
// Resolve does through a tagged reference: the tag's manifest, ErrNotFound
// for a tag that names nothing, the tag's move seen at once.
func TestResolveTag(t *testing.T) {
	ctx := t.Context()
	t.Run("layout", func(t *testing.T) {
		dir := t.TempDir()
		repo := openLayout(t, "oci:"+dir)
		a, err := putTagged(ctx, repo, testManifest(t, repo, "a", "a"))
		if err != nil {
			t.Fatal(err)
		}
		b, err := putTagged(ctx, repo, testManifest(t, repo, "b", "b"))
		if err != nil {
			t.Fatal(err)
		}
		checkResolveTag(t, repo, a, b)
		// A repository opened at another tag, or at a digest, still
		// resolves the tag asked for.
		for _, ref := range []string{"oci:" + dir + ":other", "oci:" + dir + "@" + a.Digest.String()} {
			if r, err := openLayout(t, ref).ResolveTag(ctx, "v1"); err != nil || r.Digest != b.Digest {
				t.Fatalf("through %s: v1 resolves to %v, %v; want %s", ref, r.Digest, err, b.Digest)
			}
		}
	})
	t.Run("registry", func(t *testing.T) {
		f := newFakeRegistry(t)
		repo := f.open(t, "vms/disk")
		descs, datas := testChunks(t, 2, 1<<10)
		putChunks(t, repo, descs, datas)
		a := pushDisk(t, repo, descs[:1], nil)
		b := pushDisk(t, repo, descs, nil)
		checkResolveTag(t, repo, a, b)
	})
}

// checkResolveTag: v1 names nothing (ErrNotFound), then a, then b.
func checkResolveTag(t *testing.T, repo Repository, a, b ocispec.Descriptor) {
	t.Helper()
	ctx := t.Context()
	if _, err := repo.ResolveTag(ctx, "v1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a tag that names nothing: %v, want ErrNotFound", err)
	}
	for _, d := range []ocispec.Descriptor{a, b} {
		if err := TagManifest(ctx, repo, d, "v1"); err != nil {
			t.Fatal(err)
		}
		if r, err := repo.ResolveTag(ctx, "v1"); err != nil || r.Digest != d.Digest {
			t.Fatalf("v1 resolves to %v, %v; want %s", r.Digest, err, d.Digest)
		}
	}
	if ref := repo.Reference(); ref.Tag != "" || ref.IsDigest() {
		t.Fatalf("the repository's reference changed to %s", ref)
	}
}
