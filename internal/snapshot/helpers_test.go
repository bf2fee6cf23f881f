package snapshot

import (
	"context"

	"crypto/rand"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/vmsnap/vmsnap/ociimage"
	"testing"
)

// randomState is a VM state of n bytes, half random, half zeros (as the
// agent's tests make it).
func randomState(t testing.TB, n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b[:n/2])
	return b
}

// pushTagged is ociimage.PushArtifact, then the tag of repo's reference, if
// any (PutManifest stores by digest only).
func pushTagged(ctx context.Context, repo ociimage.Repository, a ociimage.Artifact) (ocispec.Descriptor, error) {
	desc, err := ociimage.PushArtifact(ctx, repo, a)
	if tag := repo.Reference().Tag; err == nil && tag != "" {
		err = ociimage.TagManifest(ctx, repo, desc, tag)
	}
	return desc, err
}
