package ociimage

import (
	"fmt"

	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// The checks here are shared by every Repository implementation, so that a
// layout and a registry accept and refuse the same manifests.

// encodeManifest completes m (schema version, media type, an empty rather
// than null layer list), checks it and returns it with its JSON and the
// descriptor that names it. Errors are INVALID_INPUT.
func encodeManifest(m ocispec.Manifest) (ocispec.Manifest, []byte, ocispec.Descriptor, error) {
	completeHead(&m.SchemaVersion, &m.MediaType, ocispec.MediaTypeImageManifest)
	if m.Layers == nil {
		m.Layers = []ocispec.Descriptor{}
	}
	if err := checkManifest(m); err != nil {
		return m, nil, ocispec.Descriptor{}, err
	}
	b, desc, err := encodeChecked(m, "manifest", "; use fewer, larger chunks", m.MediaType, m.ArtifactType)
	return m, b, desc, err
}

// decodeManifest parses verified manifest bytes and checks them. Unknown
// fields are allowed, as the image spec asks of readers; everything vmsnap
// relies on is checked.
func decodeManifest(b []byte) (ocispec.Manifest, error) {
	return decodeChecked(b, "manifest", checkManifest)
}

// checkManifest refuses manifests vmsnap cannot read safely. Errors are
// INVALID_INPUT.
func checkManifest(m ocispec.Manifest) error {
	if err := checkHead("manifest", m.SchemaVersion, m.MediaType, ocispec.MediaTypeImageManifest); err != nil {
		return err
	}
	if len(m.Layers) > MaxLayers {
		return errcode.New(errcode.InvalidInput, "manifest has %d layers, more than the %d vmsnap accepts", len(m.Layers), MaxLayers)
	}
	if err := checkDescriptor("config", m.Config); err != nil {
		return err
	}
	for i, l := range m.Layers {
		if err := checkDescriptor(fmt.Sprintf("layer %d", i), l); err != nil {
			return err
		}
	}
	if m.Subject != nil {
		if err := checkDescriptor("subject", *m.Subject); err != nil {
			return err
		}
	}
	return nil
}

// checkDescriptor checks what every descriptor needs before it is used to
// name a file or size a buffer.
func checkDescriptor(what string, d ocispec.Descriptor) error {
	if _, err := ParseDigest(string(d.Digest)); err != nil {
		return errcode.Wrap(errcode.InvalidInput, err, "manifest %s has an invalid digest %q", what, clip(string(d.Digest)))
	}
	if d.Size < 0 {
		return errcode.New(errcode.InvalidInput, "manifest %s %s has a negative size %d", what, clip(string(d.Digest)), d.Size)
	}
	return nil
}

// index helpers: the layout's index.json, kept here next to the manifest
// checks because both decide what vmsnap accepts from disk.

func newIndex() ocispec.Index {
	return ocispec.Index{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageIndex,
		Manifests: []ocispec.Descriptor{},
	}
}

// addToIndex records desc in idx. With a tag, the tag moves to desc: any
// other entry loses it, but stays listed so its manifest remains reachable
// by digest. An entry with no tag left is dropped only if another entry
// lists the same digest. Without a tag, desc is listed once, untagged, unless
// it is listed already.
func addToIndex(idx *ocispec.Index, desc ocispec.Descriptor, tag string) {
	if tag != "" {
		for i := range idx.Manifests {
			e := &idx.Manifests[i]
			if e.Annotations[AnnotationRefName] == tag && e.Digest != desc.Digest {
				delete(e.Annotations, AnnotationRefName)
				if len(e.Annotations) == 0 {
					e.Annotations = nil
				}
			}
		}
	}

	// Find where desc goes: its entry with this tag, or an untagged entry
	// of it to take the tag.
	at := -1
	for i, e := range idx.Manifests {
		if e.Digest != desc.Digest {
			continue
		}
		name := e.Annotations[AnnotationRefName]
		if name == tag || (tag == "" && at < 0) {
			at = i
			break
		}
		if name == "" && at < 0 {
			at = i
		}
	}
	if at < 0 {
		e := desc
		if tag != "" {
			e.Annotations = map[string]string{AnnotationRefName: tag}
		}
		idx.Manifests = append(idx.Manifests, e)
	} else if tag != "" && idx.Manifests[at].Annotations[AnnotationRefName] != tag {
		e := &idx.Manifests[at]
		if e.Annotations == nil {
			e.Annotations = map[string]string{}
		}
		e.Annotations[AnnotationRefName] = tag
	}

	// Drop untagged entries whose manifest another entry already lists.
	seen := map[digest.Digest]int{}
	for _, e := range idx.Manifests {
		seen[e.Digest]++
	}
	kept := idx.Manifests[:0]
	for _, e := range idx.Manifests {
		if _, tagged := e.Annotations[AnnotationRefName]; !tagged && seen[e.Digest] > 1 {
			seen[e.Digest]--
			continue
		}
		kept = append(kept, e)
	}
	idx.Manifests = kept
}

// checkFetch refuses, before a byte is read, a blob whose descriptor has an
// invalid digest or a size outside 0..limit.
func checkFetch(what string, desc ocispec.Descriptor, limit int64) error {
	if _, err := ParseDigest(string(desc.Digest)); err != nil {
		return errcode.Wrap(errcode.InvalidInput, err, "invalid %s digest %q", what, desc.Digest)
	}
	if desc.Size < 0 || desc.Size > limit {
		return errcode.New(errcode.InvalidInput,
			"%s %s is said to be %d bytes, outside the 0 to %d vmsnap accepts; the image is corrupt or was not written by vmsnap", what, desc.Digest, desc.Size, limit)
	}
	return nil
}
