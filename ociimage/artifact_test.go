package ociimage

import (
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
	desc, err := PushArtifact(t.Context(), repo, Artifact{
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
		_, err := PushArtifact(ctx, repo, Artifact{ArtifactType: ArtifactTypeDisk, ConfigMediaType: MediaTypeDiskConfig,
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
