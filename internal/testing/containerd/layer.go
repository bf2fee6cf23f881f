package containerd

import (
	"archive/tar"
	"compress/gzip"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/klauspost/compress/zstd"
	digest "github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// RootfsDir is the host path of c's root filesystem as its task sees it:
// the mount its shim made in the task's bundle. A file written there is in
// c's writable layer (volumes are not mounted there). c's task must exist.
func (d *Daemon) RootfsDir(c *Container) string {
	return filepath.Join(d.Dir, "state", "io.containerd.runtime.v2.task", Namespace, c.ID, "rootfs")
}

// LayerEntry is one entry of a layer's tar.
type LayerEntry struct {
	Header *tar.Header
	Digest digest.Digest // of a regular file's content
}

// ReadLayer lists the entries of a layer blob of the given media type
// (uncompressed, +gzip or +zstd), by name without "./" or a trailing "/".
func ReadLayer(r io.Reader, mediaType string) (map[string]LayerEntry, error) {
	switch {
	case strings.HasSuffix(mediaType, "+zstd"):
		z, err := zstd.NewReader(r)
		if err != nil {
			return nil, err
		}
		defer z.Close()
		r = z
	case strings.HasSuffix(mediaType, "+gzip"):
		g, err := gzip.NewReader(r)
		if err != nil {
			return nil, err
		}
		defer g.Close()
		r = g
	case strings.HasSuffix(mediaType, ".tar") || strings.HasSuffix(mediaType, "tar"):
	default:
		return nil, fmt.Errorf("layer media type %q", mediaType)
	}
	tr := tar.NewReader(r)
	out := map[string]LayerEntry{}
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		e := LayerEntry{Header: hdr}
		if hdr.Typeflag == tar.TypeReg {
			d := digest.SHA256.Digester()
			if _, err := io.Copy(d.Hash(), tr); err != nil {
				return nil, err
			}
			e.Digest = d.Digest()
		}
		out[strings.TrimSuffix(strings.TrimPrefix(hdr.Name, "./"), "/")] = e
	}
}

// TopLayer lists the entries of the last layer of m (a captured writable
// layer) in the OCI layout dir.
func TopLayer(t testing.TB, dir string, m ocispec.Manifest) map[string]LayerEntry {
	t.Helper()
	top := m.Layers[len(m.Layers)-1]
	f, err := os.Open(filepath.Join(dir, "blobs", "sha256", top.Digest.Encoded()))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	entries, err := ReadLayer(f, top.MediaType)
	if err != nil {
		t.Fatal(err)
	}
	return entries
}
