package ociimage

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
)

// rangeBlob is a blob of random bytes, stored in repo.
func rangeBlob(t *testing.T, repo Repository, size int) (ocispec.Descriptor, []byte) {
	t.Helper()
	rng := rand.New(rand.NewPCG(uint64(size), 7))
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	d := ocispec.Descriptor{MediaType: MediaTypeRAMPack, Digest: digest.FromBytes(data), Size: int64(size)}
	if err := PutBlobFrom(context.Background(), repo, d, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	return d, data
}

// spans are ranges a reader of a pack asks for: its first bytes, a frame
// inside, its last bytes.
var spans = [][2]int64{{0, 100}, {1<<20 + 1, 65536}, {2 << 20, 2 << 20}, {4<<20 - 17, 17}}

func checkSpans(t *testing.T, repo Repository, d ocispec.Descriptor, data []byte) {
	t.Helper()
	for _, s := range spans {
		got, err := ReadBlobRange(context.Background(), repo, d, s[0], s[1])
		if err != nil {
			t.Fatalf("bytes %d+%d: %v", s[0], s[1], err)
		}
		if !bytes.Equal(got, data[s[0]:s[0]+s[1]]) {
			t.Fatalf("bytes %d+%d differ from the blob's", s[0], s[1])
		}
	}
	for _, s := range [][2]int64{{-1, 10}, {0, 0}, {4<<20 - 1, 2}, {0, MaxRangeSize + 1}} {
		if _, err := ReadBlobRange(context.Background(), repo, d, s[0], s[1]); errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("bytes %d+%d: got %v, want INVALID_INPUT", s[0], s[1], err)
		}
	}
}

// The real docker-registry (TLS, htpasswd) answers a Range with 206 and
// the right bytes, one request a range.
func TestRealRegistryBlobRange(t *testing.T) {
	reg := registry.Start(t)
	repo := openReal(t, reg, "vms/ranges")
	d, data := rangeBlob(t, repo, 4<<20)
	partial := regexp.MustCompile(`"GET /v2/vms/ranges/blobs/[^"]*" 206 `)
	before := len(partial.FindAllString(reg.LogTail(100000), -1))
	checkSpans(t, repo, d, data)
	if n := len(partial.FindAllString(reg.LogTail(100000), -1)) - before; n != len(spans) {
		t.Errorf("%d ranges took %d blob GETs answered 206", len(spans), n)
	}
}

func TestLayoutBlobRange(t *testing.T) {
	dir := t.TempDir()
	repo := openLayout(t, "oci:"+dir)
	d, data := rangeBlob(t, repo, 4<<20)
	checkSpans(t, repo, d, data)
	// A blob file of another size than its descriptor's is refused.
	if err := os.Truncate(filepath.Join(dir, "blobs", "sha256", d.Digest.Encoded()), 3<<20); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadBlobRange(context.Background(), repo, d, 0, 10); errcode.Of(err) != errcode.DigestMismatch {
		t.Fatalf("a short blob file: %v, want DIGEST_MISMATCH", err)
	}
}

// A registry that ignores Range and answers 200 with the whole blob
// gives the span all the same; one whose 206 is for another range is
// refused.
func TestRegistryRangeIgnoredOrWrong(t *testing.T) {
	f := newFakeRegistry(t)
	repo := f.open(t, "vm:ranges")
	d, data := rangeBlob(t, repo, 4<<20)
	path := "/v2/vm/blobs/" + string(d.Digest)
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method != http.MethodGet || r.URL.Path != path {
			return false
		}
		w.Write(data) // 200, the whole blob
		return true
	})
	checkSpans(t, repo, d, data)
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method != http.MethodGet || r.URL.Path != path {
			return false
		}
		w.Header().Set("Content-Range", fmt.Sprintf("bytes 0-99/%d", len(data)))
		w.WriteHeader(http.StatusPartialContent)
		w.Write(data[:100])
		return true
	})
	if _, err := ReadBlobRange(context.Background(), repo, d, 1000, 100); errcode.Of(err) != errcode.RegistryError || !strings.Contains(err.Error(), "Content-Range") {
		t.Fatalf("a 206 for another range: %v, want REGISTRY_ERROR naming the Content-Range", err)
	}
}
