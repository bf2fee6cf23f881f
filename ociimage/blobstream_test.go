package ociimage

import (
	"bytes"
	"context"
	"crypto/rand"
	"net/http"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

func streamBlob(t *testing.T, n int) (ocispec.Descriptor, []byte) {
	t.Helper()
	data := make([]byte, n)
	rand.Read(data)
	return ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: digest.FromBytes(data), Size: int64(n)}, data
}

// TestLayoutPutBlobStream: a streamed blob lands whole under its digest; a
// source that is shorter, longer or other than the descriptor leaves
// nothing behind, not even a temporary file.
func TestLayoutPutBlobStream(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	repo, err := Open(ctx, Reference{Layout: dir})
	if err != nil {
		t.Fatal(err)
	}
	desc, data := streamBlob(t, 3<<20+17)
	if err := PutBlobFrom(ctx, repo, desc, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	got, err := repo.Blob(ctx, desc, desc.Size)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("blob read back: %d bytes, %v", len(got), err)
	}
	// Again: already there, nothing to do.
	if err := repo.(BlobStreamer).PutBlobStream(ctx, desc, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}

	other, odata := streamBlob(t, 1<<20)
	for name, src := range map[string][]byte{
		"short": odata[:len(odata)-1],
		"long":  append(append([]byte{}, odata...), 0),
		"other": data[:len(odata)],
	} {
		err := repo.(BlobStreamer).PutBlobStream(ctx, other, bytes.NewReader(src))
		if !errcode.Is(err, errcode.DigestMismatch) {
			t.Errorf("%s source: %v, want DIGEST_MISMATCH", name, err)
		}
	}
	ents, _ := os.ReadDir(filepath.Join(dir, "blobs", "sha256"))
	if len(ents) != 1 {
		t.Errorf("blob directory holds %d files, want the one good blob", len(ents))
	}
}

// TestRegistryPutBlobStream: a streamed upload is retried from the start
// of its source after a failure, and a manifest can then name the blob.
func TestRegistryPutBlobStream(t *testing.T) {
	f := newFakeRegistry(t)
	var failed atomic.Bool
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method != http.MethodGet && r.Method != http.MethodHead && r.URL.Path != "/v2/" && failed.CompareAndSwap(false, true) {
			w.WriteHeader(http.StatusServiceUnavailable)
			return true
		}
		return false
	})
	repo := f.open(t, "vm/rootfs")
	ctx := context.Background()
	desc, data := streamBlob(t, 2<<20)
	if err := PutBlobFrom(ctx, repo, desc, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	if !failed.Load() {
		t.Fatal("the intercept never failed a request")
	}
	got, err := repo.Blob(ctx, desc, desc.Size)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("blob read back: %d bytes, %v", len(got), err)
	}
	// The registry checks the digest: wrong data is refused.
	bad, _ := streamBlob(t, 1<<10)
	err = repo.(BlobStreamer).PutBlobStream(ctx, bad, bytes.NewReader(make([]byte, 1<<10)))
	if !errcode.Is(err, errcode.DigestMismatch) {
		t.Fatalf("the registry given data that does not match its digest: %v, want DIGEST_MISMATCH", err)
	}
}

// plainRepo hides the streaming of a Layout.
type plainRepo struct{ Repository }

// TestPutBlobFromWithoutStreaming: a repository that cannot stream gets
// small blobs through PutBlob and refuses large ones before reading them.
func TestPutBlobFromWithoutStreaming(t *testing.T) {
	ctx := context.Background()
	l, err := Open(ctx, Reference{Layout: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	repo := plainRepo{l}
	desc, data := streamBlob(t, 1<<10)
	if err := PutBlobFrom(ctx, repo, desc, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	big := ocispec.Descriptor{Digest: digest.FromString("x"), Size: MaxChunkSize + 1}
	if err := PutBlobFrom(ctx, repo, big, bytes.NewReader(nil)); !errcode.Is(err, errcode.InvalidInput) {
		t.Fatalf("large blob through PutBlob: %v, want INVALID_INPUT", err)
	}
}
