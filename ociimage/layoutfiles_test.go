package ociimage

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/beneath"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/guard"
)

// layoutWithImage is a layout in a fresh directory holding one tagged
// manifest of two chunks.
func layoutWithImage(t *testing.T) (string, ocispec.Descriptor, ocispec.Manifest) {
	t.Helper()
	dir := t.TempDir()
	repo := openLayout(t, "oci:"+dir+":t")
	m := testManifest(t, repo, "n", "first chunk", "second chunk")
	desc, err := repo.PutManifest(t.Context(), m)
	if err != nil {
		t.Fatal(err)
	}
	if err := TagManifest(t.Context(), repo, desc, "t"); err != nil {
		t.Fatal(err)
	}
	return dir, desc, m
}

// readImage resolves the layout's image and reads its manifest and
// layers, failing the test if that blocks and ending it if it reads without
// bound (internal/testing/guard).
func readImage(t *testing.T, repo Repository, desc ocispec.Descriptor) error {
	t.Helper()
	return guard.Within(t, time.Minute, 1<<30, "reading the layout", func() error {
		if _, err := repo.Resolve(t.Context()); err != nil {
			return err
		}
		m, err := repo.Manifest(t.Context(), desc)
		for _, l := range m.Layers {
			if err == nil {
				_, err = repo.Blob(t.Context(), l, 1<<20)
			}
		}
		return err
	})
}

// Whoever may write a layout's directory can put in place of its files a
// FIFO, a link to a device, or a link out of the layout. Read by path (a
// layout of the caller's own) or beneath a handle (a directory someone
// else may have written), a layout reads regular files only, within their
// bounds, and beneath a handle follows no link at all.
func TestLayoutReadsOnlyRegularFiles(t *testing.T) {
	other := t.TempDir()
	if err := os.WriteFile(filepath.Join(other, "secret"), []byte("another layout's blob"), 0o600); err != nil {
		t.Fatal(err)
	}
	fifo := func(p string) error { os.Remove(p); return unix.Mkfifo(p, 0o600) }
	link := func(to string) func(string) error {
		return func(p string) error { os.Remove(p); return os.Symlink(to, p) }
	}
	for _, tc := range []struct {
		name     string
		file     func(m ocispec.Manifest, desc ocispec.Descriptor) string // which file, inside the layout
		plant    func(string) error
		byPathOK bool // a link followed by path reaches a regular file
	}{
		{"oci-layout is a FIFO", layoutFile, fifo, false},
		{"oci-layout links to /dev/zero", layoutFile, link("/dev/zero"), false},
		{"index.json links to /dev/zero", indexFile, link("/dev/zero"), false},
		{"the manifest is a FIFO", manifestFile, fifo, false},
		{"a layer links to /dev/zero", layerFile, link("/dev/zero"), false},
		{"a layer links out of the layout", layerFile, link(filepath.Join(other, "secret")), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir, desc, m := layoutWithImage(t)
			p := filepath.Join(dir, tc.file(m, desc))
			if err := tc.plant(p); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unblock(p) })
			byPath := openLayout(t, "oci:"+dir+":t")
			if err := readImage(t, byPath, desc); err == nil && !tc.byPathOK {
				t.Error("read by path: no error")
			}
			h, err := beneath.Dir(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close()
			in := OpenLayoutIn(h, Reference{Layout: dir, Tag: "t"})
			if err := readImage(t, in, desc); err == nil {
				t.Error("read beneath a handle: no error")
			}
		})
	}
}

func layoutFile(ocispec.Manifest, ocispec.Descriptor) string { return ocispec.ImageLayoutFile }
func indexFile(ocispec.Manifest, ocispec.Descriptor) string  { return ocispec.ImageIndexFile }
func manifestFile(_ ocispec.Manifest, d ocispec.Descriptor) string {
	return blobRel(d.Digest)
}
func layerFile(m ocispec.Manifest, _ ocispec.Descriptor) string { return blobRel(m.Layers[1].Digest) }

// unblock lets a reader blocked opening the FIFO at p go on.
func unblock(p string) {
	if fd, err := unix.Open(p, unix.O_WRONLY|unix.O_NONBLOCK, 0); err == nil {
		unix.Close(fd)
	}
}

// A layout opened beneath a handle reads the image, and writes nothing.
func TestLayoutInReadsAndNeverWrites(t *testing.T) {
	dir, desc, m := layoutWithImage(t)
	h, err := beneath.Dir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	in := OpenLayoutIn(h, Reference{Layout: dir, Digest: desc.Digest})
	if err := readImage(t, in, desc); err != nil {
		t.Fatalf("reading an intact layout beneath a handle: %v", err)
	}
	if b, err := in.Blob(t.Context(), m.Layers[0], 1<<20); err != nil || string(b) != "first chunk" {
		t.Fatalf("first layer: %q, %v", b, err)
	}
	before, _ := os.ReadDir(filepath.Join(dir, "blobs", "sha256"))
	if err := in.PutBlob(t.Context(), blobDesc(MediaTypeChunk, []byte("new")), []byte("new")); errcode.Of(err) != errcode.Internal {
		t.Errorf("PutBlob: %v, want refused", err)
	}
	if err := in.TagManifest(t.Context(), desc, "other"); err == nil {
		t.Error("TagManifest: no error")
	}
	if after, _ := os.ReadDir(filepath.Join(dir, "blobs", "sha256")); len(after) != len(before) {
		t.Errorf("the layout has %d blobs, had %d", len(after), len(before))
	}
}
