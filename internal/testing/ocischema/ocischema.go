// Package ocischema checks what vmsnap writes against the OCI image spec's
// own JSON schemas (github.com/opencontainers/image-spec/schema, the schema
// files of image-spec v1.1.1 and its validator): image manifests, image
// indexes, OCI image configs and an OCI layout's oci-layout file, found by
// walking a layout or a registry repository from its roots.
//
// It is for tests: the schemas cost a JSON schema compiler, which the
// vmsnap binary does not link. vmsnap's own config media types (the VM
// state's and the disk's) have no schema in the image spec; the manifest
// schema checks their descriptors.
package ocischema

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"

	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/schema"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Validate checks b, a document of mediaType (an image manifest or index,
// an OCI image config or an image layout header), against its schema.
func Validate(mediaType string, b []byte) error {
	v := schema.Validator(mediaType)
	switch v {
	case schema.ValidatorMediaTypeManifest, schema.ValidatorMediaTypeImageIndex,
		schema.ValidatorMediaTypeImageConfig, schema.ValidatorMediaTypeLayoutHeader:
	default:
		return fmt.Errorf("the image spec has no schema for %q", mediaType)
	}
	if err := v.Validate(bytes.NewReader(b)); err != nil {
		return fmt.Errorf("%s: %w", mediaType, err)
	}
	return nil
}

// Source is where Graph reads documents: a manifest or index by its
// descriptor (its raw bytes, as stored), and a blob.
type Source interface {
	Manifest(ctx context.Context, desc ocispec.Descriptor) ([]byte, error)
	Blob(ctx context.Context, desc ocispec.Descriptor) ([]byte, error)
}

// Checked counts the documents a walk validated, by media type.
type Checked map[string]int

// Graph validates the manifest or index root names and everything below
// it: every index and manifest against its schema, every config that is an
// OCI image config against the config schema. Each document's bytes are
// checked against its digest first.
func Graph(ctx context.Context, src Source, root ocispec.Descriptor) (Checked, error) {
	w := newWalker(src)
	err := w.walk(ctx, root)
	return w.checked, err
}

// walker validates graphs, each document once.
type walker struct {
	src     Source
	seen    map[digest.Digest]bool
	checked Checked
}

func newWalker(src Source) *walker {
	return &walker{src: src, seen: map[digest.Digest]bool{}, checked: Checked{}}
}

func (w *walker) walk(ctx context.Context, root ocispec.Descriptor) error {
	todo := []ocispec.Descriptor{root}
	for len(todo) > 0 {
		desc := todo[len(todo)-1]
		todo = todo[:len(todo)-1]
		if w.seen[desc.Digest] {
			continue
		}
		w.seen[desc.Digest] = true
		below, err := w.check(ctx, desc)
		if err != nil {
			return err
		}
		todo = append(todo, below...)
	}
	return nil
}

// check validates the manifest or index desc names, and its config, and
// returns the manifests it lists.
func (w *walker) check(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
	b, err := w.src.Manifest(ctx, desc)
	if err != nil {
		return nil, err
	}
	if digest.FromBytes(b) != desc.Digest {
		return nil, fmt.Errorf("%s: the bytes read have digest %s", desc.Digest, digest.FromBytes(b))
	}
	var head struct {
		MediaType string               `json:"mediaType"`
		Config    *ocispec.Descriptor  `json:"config"`
		Manifests []ocispec.Descriptor `json:"manifests"`
	}
	if err := json.Unmarshal(b, &head); err != nil {
		return nil, fmt.Errorf("%s: %w", desc.Digest, err)
	}
	if head.MediaType != desc.MediaType && desc.MediaType != "" {
		return nil, fmt.Errorf("%s is described as %s but says it is %s", desc.Digest, desc.MediaType, head.MediaType)
	}
	if err := Validate(head.MediaType, b); err != nil {
		return nil, fmt.Errorf("%s: %w", desc.Digest, err)
	}
	w.checked[head.MediaType]++
	if head.Config != nil && head.Config.MediaType == ocispec.MediaTypeImageConfig {
		if err := checkConfig(ctx, w.src, *head.Config); err != nil {
			return nil, err
		}
		w.checked[ocispec.MediaTypeImageConfig]++
	}
	return head.Manifests, nil
}

func checkConfig(ctx context.Context, src Source, desc ocispec.Descriptor) error {
	b, err := src.Blob(ctx, desc)
	if err != nil {
		return err
	}
	if digest.FromBytes(b) != desc.Digest {
		return fmt.Errorf("config %s: the bytes read have digest %s", desc.Digest, digest.FromBytes(b))
	}
	if err := Validate(desc.MediaType, b); err != nil {
		return fmt.Errorf("config %s: %w", desc.Digest, err)
	}
	return nil
}
