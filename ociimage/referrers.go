package ociimage

import (
	"context"
	"encoding/json"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Referrers lists the manifests in the layout whose subject is desc. A
// layout has no referrers index: every image manifest index.json lists is
// read (each is small) and its subject compared.
func (l *Layout) Referrers(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if _, err := ParseDigest(string(desc.Digest)); err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "invalid manifest digest %q", desc.Digest)
	}
	idx, err := l.index()
	if err != nil {
		return nil, err
	}
	var out []ocispec.Descriptor
	seen := map[string]bool{}
	for _, e := range idx.Manifests {
		if seen[string(e.Digest)] || e.Digest == desc.Digest ||
			(e.MediaType != "" && e.MediaType != ocispec.MediaTypeImageManifest) {
			continue
		}
		seen[string(e.Digest)] = true
		b, err := l.readBlob(ctx, "manifest", e, MaxManifestSize)
		if err != nil {
			return nil, err
		}
		var m struct {
			MediaType    string              `json:"mediaType"`
			ArtifactType string              `json:"artifactType"`
			Config       ocispec.Descriptor  `json:"config"`
			Subject      *ocispec.Descriptor `json:"subject"`
			Annotations  map[string]string   `json:"annotations"`
		}
		if json.Unmarshal(b, &m) != nil || m.Subject == nil || m.Subject.Digest != desc.Digest {
			continue
		}
		// Described as the referrers API describes a referrer.
		at := m.ArtifactType
		if at == "" {
			at = m.Config.MediaType
		}
		out = append(out, ocispec.Descriptor{
			MediaType: ocispec.MediaTypeImageManifest, Digest: e.Digest, Size: e.Size,
			ArtifactType: at, Annotations: m.Annotations,
		})
	}
	return out, nil
}
