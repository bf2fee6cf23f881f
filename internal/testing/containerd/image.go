package containerd

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path"
	"runtime"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	digest "github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// busyboxPath is Debian busybox-static's binary: statically linked, so it
// is a whole userland on its own.
const busyboxPath = "/bin/busybox"

// BusyboxImageName names the default image: /bin/busybox and nothing else,
// with "busybox sleep 3600" as its command.
const BusyboxImageName = "vmsnap.test/busybox:latest"

// File is one file of an image built by ImportImage: Data, or the contents
// of HostPath, at Path (absolute, inside the image).
type File struct {
	Path     string
	HostPath string
	Data     []byte
	Mode     os.FileMode // 0755 when zero
}

// ImageConfig is the part of an image's configuration ImportImage sets.
type ImageConfig struct {
	Entrypoint []string
	Cmd        []string
	Env        []string
	User       string
	WorkingDir string
}

// BusyboxImage returns the default image, importing it on first use.
func (d *Daemon) BusyboxImage(t testing.TB) client.Image {
	t.Helper()
	d.imageOnce.Do(func() {
		tarball, err := BuildImageTar(BusyboxImageName, []File{{Path: "/bin/busybox", HostPath: busyboxPath}},
			ImageConfig{Entrypoint: []string{"/bin/busybox"}, Cmd: []string{"sleep", "3600"}, Env: []string{"PATH=/bin"}})
		if err != nil {
			d.imageErr = err
			return
		}
		d.image, d.imageErr = d.importImage(BusyboxImageName, tarball)
	})
	if d.imageErr != nil {
		t.Fatalf("importing %s: %v", BusyboxImageName, d.imageErr)
	}
	return d.image
}

// ImportImage builds a one-layer image of files, imports it under name and
// unpacks it into the snapshotter.
func (d *Daemon) ImportImage(t testing.TB, name string, files []File, cfg ImageConfig) client.Image {
	t.Helper()
	tarball, err := BuildImageTar(name, files, cfg)
	if err != nil {
		t.Fatal(err)
	}
	img, err := d.importImage(name, tarball)
	if err != nil {
		t.Fatalf("importing %s: %v", name, err)
	}
	return img
}

// ImportTar imports an image tarball (BuildImageTar) under name and
// unpacks it into the snapshotter.
func (d *Daemon) ImportTar(t testing.TB, name string, tarball []byte) client.Image {
	t.Helper()
	img, err := d.importImage(name, tarball)
	if err != nil {
		t.Fatalf("importing %s: %v\n%s", name, err, d.logTail())
	}
	return img
}

func (d *Daemon) importImage(name string, tarball []byte) (client.Image, error) {
	ctx, cancel := context.WithTimeout(d.Context(context.Background()), time.Minute)
	defer cancel()
	imgs, err := d.Client.Import(ctx, bytes.NewReader(tarball))
	if err != nil {
		return nil, err
	}
	for _, im := range imgs {
		if im.Name == name {
			img := client.NewImageWithPlatform(d.Client, im, nil)
			if err := img.Unpack(ctx, Snapshotter); err != nil {
				return nil, fmt.Errorf("unpack: %w", err)
			}
			return d.Client.GetImage(ctx, name)
		}
	}
	return nil, fmt.Errorf("import made no image named %s (%d images)", name, len(imgs))
}

// Context returns ctx in the harness's containerd namespace.
func (d *Daemon) Context(ctx context.Context) context.Context {
	return namespaces.WithNamespace(ctx, Namespace)
}

// BuildImageTar returns an OCI image layout as a tar stream (what
// `ctr image import` and the client's Import read) holding one image named
// name for this machine's architecture, with one uncompressed layer of
// files. Parent directories are created as needed.
func BuildImageTar(name string, files []File, cfg ImageConfig) ([]byte, error) {
	layer, err := layerTar(files)
	if err != nil {
		return nil, err
	}
	layerDigest := digest.FromBytes(layer)
	created := time.Unix(0, 0).UTC()
	config := ocispec.Image{
		Created:  &created,
		Platform: ocispec.Platform{Architecture: runtime.GOARCH, OS: "linux"},
		Config: ocispec.ImageConfig{
			Entrypoint: cfg.Entrypoint, Cmd: cfg.Cmd, Env: cfg.Env,
			User: cfg.User, WorkingDir: cfg.WorkingDir,
		},
		RootFS: ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{layerDigest}},
	}
	configJSON, err := json.Marshal(config)
	if err != nil {
		return nil, err
	}
	manifest := ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest,
		Config: ocispec.Descriptor{
			MediaType: ocispec.MediaTypeImageConfig,
			Digest:    digest.FromBytes(configJSON),
			Size:      int64(len(configJSON)),
		},
		Layers: []ocispec.Descriptor{{
			MediaType: ocispec.MediaTypeImageLayer,
			Digest:    layerDigest,
			Size:      int64(len(layer)),
		}},
	}
	manifestJSON, err := json.Marshal(manifest)
	if err != nil {
		return nil, err
	}
	tag := name
	if i := strings.LastIndex(name, ":"); i > strings.LastIndex(name, "/") {
		tag = name[i+1:]
	}
	index := ocispec.Index{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageIndex,
		Manifests: []ocispec.Descriptor{{
			MediaType: ocispec.MediaTypeImageManifest,
			Digest:    digest.FromBytes(manifestJSON),
			Size:      int64(len(manifestJSON)),
			Platform:  &ocispec.Platform{Architecture: runtime.GOARCH, OS: "linux"},
			Annotations: map[string]string{
				"io.containerd.image.name": name,
				ocispec.AnnotationRefName:  tag,
			},
		}},
	}
	indexJSON, err := json.Marshal(index)
	if err != nil {
		return nil, err
	}

	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	add := func(name string, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), ModTime: created, Typeflag: tar.TypeReg}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	for _, dir := range []string{"blobs/", "blobs/sha256/"} {
		if err := tw.WriteHeader(&tar.Header{Name: dir, Mode: 0o755, ModTime: created, Typeflag: tar.TypeDir}); err != nil {
			return nil, err
		}
	}
	for _, f := range []struct {
		name string
		data []byte
	}{
		{ocispec.ImageLayoutFile, []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", indexJSON},
		{"blobs/sha256/" + layerDigest.Encoded(), layer},
		{"blobs/sha256/" + digest.FromBytes(configJSON).Encoded(), configJSON},
		{"blobs/sha256/" + digest.FromBytes(manifestJSON).Encoded(), manifestJSON},
	} {
		if err := add(f.name, f.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// layerTar is an uncompressed layer holding files and their parent
// directories, owned by root.
func layerTar(files []File) ([]byte, error) {
	type entry struct {
		hdr  tar.Header
		data []byte
	}
	entries := map[string]entry{}
	epoch := time.Unix(0, 0).UTC()
	for _, f := range files {
		p := path.Clean("/" + f.Path)
		if p == "/" {
			return nil, fmt.Errorf("file with no path")
		}
		data := f.Data
		if f.HostPath != "" {
			b, err := os.ReadFile(f.HostPath)
			if err != nil {
				return nil, err
			}
			data = b
		}
		mode := f.Mode
		if mode == 0 {
			mode = 0o755
		}
		name := strings.TrimPrefix(p, "/")
		entries[name] = entry{tar.Header{Name: name, Mode: int64(mode.Perm()), Size: int64(len(data)), ModTime: epoch, Typeflag: tar.TypeReg}, data}
		for dir := path.Dir(name); dir != "." && dir != "/"; dir = path.Dir(dir) {
			if _, ok := entries[dir+"/"]; !ok {
				entries[dir+"/"] = entry{hdr: tar.Header{Name: dir + "/", Mode: 0o755, ModTime: epoch, Typeflag: tar.TypeDir}}
			}
		}
	}
	names := make([]string, 0, len(entries))
	for n := range entries {
		names = append(names, n)
	}
	sort.Strings(names) // parents before children
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range names {
		e := entries[n]
		if err := tw.WriteHeader(&e.hdr); err != nil {
			return nil, err
		}
		if len(e.data) > 0 {
			if _, err := tw.Write(e.data); err != nil {
				return nil, err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// ImportLayout imports the image manifest m of the OCI layout dir into
// containerd under name and unpacks it, as a node pulling that image would:
// the way to run a container from an image vmsnap captured.
func (d *Daemon) ImportLayout(t testing.TB, dir string, m ocispec.Descriptor, name string) client.Image {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	add := func(name string, data []byte) {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(data); err != nil {
			t.Fatal(err)
		}
	}
	blobs, err := os.ReadDir(path.Join(dir, "blobs", "sha256"))
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range blobs {
		if strings.HasPrefix(b.Name(), ".") { // a temporary file
			continue
		}
		data, err := os.ReadFile(path.Join(dir, "blobs", "sha256", b.Name()))
		if err != nil {
			t.Fatal(err)
		}
		add("blobs/sha256/"+b.Name(), data)
	}
	m.Annotations = map[string]string{"io.containerd.image.name": name}
	idx, err := json.Marshal(ocispec.Index{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{m}})
	if err != nil {
		t.Fatal(err)
	}
	add("index.json", idx)
	add(ocispec.ImageLayoutFile, []byte(`{"imageLayoutVersion":"1.0.0"}`))
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	img, err := d.importImage(name, buf.Bytes())
	if err != nil {
		t.Fatalf("importing %s from %s: %v\n%s", m.Digest, dir, err, d.logTail())
	}
	return img
}
