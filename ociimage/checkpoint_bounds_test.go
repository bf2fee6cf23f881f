package ociimage

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// maxRefusalBytes bounds the message of a refusal of what a tenant wrote:
// the agent keeps an operation's error in memory, in its journal and in its
// event stream, so a message that carries a megabyte string from an index
// costs the node that megabyte for every request that names it.
const maxRefusalBytes = 4 << 10

// A checkpoint index may be a few MiB of strings its writer chose (a link,
// a part's name or media type, an entry's digest, the disk-in-rootfs path):
// every refusal of one quotes at most a clip of it.
func TestCheckpointRefusalsQuoteAClipOfWhatTheIndexSays(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	repo := openLayout(t, "oci:"+dir)
	state, _ := twoParts(t, repo)
	// DEL is one byte in JSON and four in a quoted Go string.
	huge := strings.Repeat("\x7f", 1<<20)
	marked := func(more ...string) map[string]string {
		a := map[string]string{AnnotationCheckpoint: ArtifactTypeCheckpoint}
		for i := 0; i+1 < len(more); i += 2 {
			a[more[i]] = more[i+1]
		}
		return a
	}
	stateEntry := func(part, mediaType string) ocispec.Descriptor {
		return ocispec.Descriptor{MediaType: mediaType, Digest: state.Digest, Size: state.Size, Annotations: map[string]string{AnnotationPart: part}}
	}
	// raw stores an index as its writer wrote it, past what PutIndex checks.
	raw := func(t *testing.T, idx map[string]any) ocispec.Descriptor {
		b, err := json.Marshal(idx)
		if err != nil {
			t.Fatal(err)
		}
		d := digest.FromBytes(b)
		if err := repo.putBlob(d, b); err != nil {
			t.Fatal(err)
		}
		return ocispec.Descriptor{MediaType: ocispec.MediaTypeImageIndex, Digest: d, Size: int64(len(b))}
	}
	for name, c := range map[string]struct {
		idx  func(t *testing.T) ocispec.Descriptor
		part string
		// read: the index is read as such (a layout describes a blob it
		// does not list by the media type the blob claims).
		read bool
	}{
		"disk link": {part: PartDisk, idx: func(t *testing.T) ocispec.Descriptor {
			return put(t, repo, ocispec.Index{Manifests: []ocispec.Descriptor{stateEntry(PartVMState, state.MediaType)}, Annotations: marked(AnnotationDiskLink, huge+"@"+state.Digest.String())})
		}},
		"rootfs link without a digest": {part: PartVMState, idx: func(t *testing.T) ocispec.Descriptor {
			return put(t, repo, ocispec.Index{Manifests: []ocispec.Descriptor{stateEntry(PartVMState, state.MediaType)}, Annotations: marked(AnnotationRootfsLink, "x@"+huge)})
		}},
		"part name": {part: PartVMState, idx: func(t *testing.T) ocispec.Descriptor {
			return put(t, repo, ocispec.Index{Manifests: []ocispec.Descriptor{stateEntry(huge, state.MediaType)}, Annotations: marked()})
		}},
		"part media type": {part: PartVMState, idx: func(t *testing.T) ocispec.Descriptor {
			return put(t, repo, ocispec.Index{Manifests: []ocispec.Descriptor{stateEntry(PartVMState, huge)}, Annotations: marked()})
		}},
		"disk in the rootfs at": {part: PartDisk, idx: func(t *testing.T) ocispec.Descriptor {
			return put(t, repo, ocispec.Index{Manifests: []ocispec.Descriptor{stateEntry(PartVMState, state.MediaType)}, Annotations: marked(AnnotationDiskRootfsPath, huge)})
		}},
		"index media type": {part: PartVMState, read: true, idx: func(t *testing.T) ocispec.Descriptor {
			return raw(t, map[string]any{"schemaVersion": 2, "mediaType": huge, "manifests": []any{}})
		}},
		"entry digest": {part: PartVMState, read: true, idx: func(t *testing.T) ocispec.Descriptor {
			return raw(t, map[string]any{"schemaVersion": 2, "mediaType": ocispec.MediaTypeImageIndex, "annotations": marked(),
				"manifests": []any{map[string]any{"mediaType": ocispec.MediaTypeImageManifest, "digest": "sha256:" + huge, "size": 1}}})
		}},
	} {
		t.Run(name, func(t *testing.T) {
			desc := c.idx(t)
			var err error
			if c.read {
				_, err = ReadCheckpoint(ctx, repo, desc)
			} else {
				_, _, err = OpenPart(ctx, Reference{Layout: dir, Digest: desc.Digest}, c.part)
			}
			if errcode.Of(err) != errcode.InvalidInput {
				t.Fatalf("%v, want INVALID_INPUT", clip(errString(err)))
			}
			if n := len(err.Error()); n > maxRefusalBytes {
				t.Fatalf("the refusal is %d bytes (more than %d): %s", n, maxRefusalBytes, clip(err.Error()))
			}
		})
	}
}

func put(t *testing.T, repo Repository, idx ocispec.Index) ocispec.Descriptor {
	t.Helper()
	desc, err := repo.PutIndex(t.Context(), idx)
	if err != nil {
		t.Fatal(err)
	}
	return desc
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}

// A manifest of another artifact type, or config type, than the reader
// wants is refused with a clip of the type its writer gave it.
func TestArtifactTypeRefusalQuotesAClip(t *testing.T) {
	repo := openLayout(t, "oci:"+t.TempDir())
	descs, datas := testChunks(t, 1, 1<<10)
	putChunks(t, repo, descs, datas)
	huge := "application/x" + strings.Repeat("\x7f", 1<<20)
	for name, a := range map[string]Artifact{
		"artifact type": {ArtifactType: huge, ConfigMediaType: MediaTypeVMStateConfig},
		"config type":   {ArtifactType: ArtifactTypeVMState, ConfigMediaType: huge},
	} {
		t.Run(name, func(t *testing.T) {
			a.Config, a.Layers = regConfig{Name: "state"}, descs
			desc, err := PushArtifact(t.Context(), repo, a)
			if err != nil {
				t.Fatal(err)
			}
			var cfg regConfig
			_, _, err = PullArtifact(t.Context(), Pinned(repo, desc), ArtifactTypeVMState, &cfg)
			if errcode.Of(err) != errcode.InvalidInput {
				t.Fatalf("%v, want INVALID_INPUT", clip(errString(err)))
			}
			if n := len(err.Error()); n > maxRefusalBytes {
				t.Fatalf("the refusal is %d bytes (more than %d): %s", n, maxRefusalBytes, clip(err.Error()))
			}
		})
	}
}
