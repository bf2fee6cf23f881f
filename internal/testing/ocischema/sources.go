package ocischema

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Layout validates the OCI layout in dir: its oci-layout file, its
// index.json (an image index) and the graph of every manifest it lists.
func Layout(ctx context.Context, dir string) (Checked, error) {
	header, err := os.ReadFile(filepath.Join(dir, ocispec.ImageLayoutFile))
	if err != nil {
		return nil, err
	}
	if err := Validate(ocispec.MediaTypeLayoutHeader, header); err != nil {
		return nil, fmt.Errorf("%s/%s: %w", dir, ocispec.ImageLayoutFile, err)
	}
	b, err := os.ReadFile(filepath.Join(dir, ocispec.ImageIndexFile))
	if err != nil {
		return nil, err
	}
	if err := Validate(ocispec.MediaTypeImageIndex, b); err != nil {
		return nil, fmt.Errorf("%s/%s: %w", dir, ocispec.ImageIndexFile, err)
	}
	var idx ocispec.Index
	if err := json.Unmarshal(b, &idx); err != nil {
		return nil, err
	}
	w := newWalker(layoutSource(dir))
	w.checked[ocispec.MediaTypeLayoutHeader]++
	for _, m := range idx.Manifests {
		if err := w.walk(ctx, m); err != nil {
			return w.checked, fmt.Errorf("%s: %w", dir, err)
		}
	}
	return w.checked, nil
}

// layoutSource reads an OCI layout's blobs.
type layoutSource string

func (l layoutSource) Manifest(ctx context.Context, desc ocispec.Descriptor) ([]byte, error) {
	return l.Blob(ctx, desc)
}

func (l layoutSource) Blob(_ context.Context, desc ocispec.Descriptor) ([]byte, error) {
	return os.ReadFile(filepath.Join(string(l), ocispec.ImageBlobsDir, desc.Digest.Algorithm().String(), desc.Digest.Encoded()))
}

// Registry is a Source that reads repository repo (HOST[:PORT]/PATH) of a
// registry with go-containerregistry's client and opts (its transport and
// credentials).
func Registry(repo string, opts ...remote.Option) Source { return registrySource{repo, opts} }

type registrySource struct {
	repo string
	opts []remote.Option
}

func (r registrySource) Manifest(ctx context.Context, desc ocispec.Descriptor) ([]byte, error) {
	ref, err := name.NewDigest(r.repo + "@" + desc.Digest.String())
	if err != nil {
		return nil, err
	}
	d, err := remote.Get(ref, append(r.opts, remote.WithContext(ctx))...)
	if err != nil {
		return nil, err
	}
	return d.Manifest, nil
}

func (r registrySource) Blob(ctx context.Context, desc ocispec.Descriptor) ([]byte, error) {
	ref, err := name.NewDigest(r.repo + "@" + desc.Digest.String())
	if err != nil {
		return nil, err
	}
	l, err := remote.Layer(ref, append(r.opts, remote.WithContext(ctx))...)
	if err != nil {
		return nil, err
	}
	rc, err := l.Compressed()
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	return io.ReadAll(io.LimitReader(rc, 1<<20))
}

// RegistryTag validates the graph the tag (or digest: "@sha256:...")
// names in repository repo, read as Registry reads it.
func RegistryTag(ctx context.Context, repo, tagOrDigest string, opts ...remote.Option) (Checked, error) {
	ref, err := name.ParseReference(repo + tagOrDigest)
	if err != nil {
		return nil, err
	}
	d, err := remote.Head(ref, append(opts, remote.WithContext(ctx))...)
	if err != nil {
		return nil, err
	}
	root := ocispec.Descriptor{MediaType: string(d.MediaType), Digest: digest.Digest(d.Digest.String()), Size: d.Size}
	return Graph(ctx, Registry(repo, opts...), root)
}
