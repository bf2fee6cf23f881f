// Package prunetest holds the checks the prune tests of the operations
// library (internal/snapshot) and of the agent share: which checkpoints a
// prune reported, and whether a store still holds a manifest. It is for
// tests only.
package prunetest

import (
	"context"
	"errors"
	"testing"

	"github.com/opencontainers/go-digest"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/ociimage"
)

// Digests lists the checkpoints' digests, in their order.
func Digests(cps []api.PrunedCheckpoint) []string {
	var out []string
	for _, c := range cps {
		out = append(out, c.Digest)
	}
	return out
}

// ManifestGone says whether the store of image (its tag ignored) no longer
// holds the manifest d.
func ManifestGone(t *testing.T, image string, d string, opts []ociimage.Option) bool {
	t.Helper()
	ref, err := ociimage.ParseReference(image)
	if err != nil {
		t.Fatal(err)
	}
	ref.Tag = ""
	repo, err := ociimage.Open(context.Background(), ref, opts...)
	if err != nil {
		t.Fatal(err)
	}
	_, err = repo.(ociimage.DigestResolver).ResolveDigest(context.Background(), digest.Digest(d))
	if err != nil && !errors.Is(err, ociimage.ErrNotFound) {
		t.Fatal(err)
	}
	return errors.Is(err, ociimage.ErrNotFound)
}
