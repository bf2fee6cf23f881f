package ociimage

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// TestRegistryListTagsFollowsTheLinkHeader: the tag list comes page by
// page as Link says; a tag that is not a valid tag name is dropped (it
// would go into a request path); each tag is resolved to what it names.
func TestRegistryListTagsFollowsTheLinkHeader(t *testing.T) {
	f := newFakeRegistry(t)
	descs, datas := testChunks(t, 1, 1024)
	want := map[string]digest.Digest{}
	for _, tag := range []string{"a", "b", "c"} {
		repo := f.open(t, "vm:"+tag)
		putChunks(t, repo, descs, datas)
		want[tag] = pushDisk(t, repo, descs[:1], nil).Digest
		descs[0].Annotations = map[string]string{AnnotationRawSize: "1024", "n": tag} // another manifest each time
	}
	pages := map[string]string{
		"":  `{"name":"vm","tags":["a"]}` + "\n</v2/vm/tags/list?n=1000&last=a>; rel=\"next\"",
		"a": `{"name":"vm","tags":["b","../../x"]}` + "\n</v2/vm/tags/list?n=1000&last=b>; rel=\"next\"",
		"b": `{"name":"vm","tags":["c"]}` + "\n",
	}
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if !strings.HasSuffix(r.URL.Path, "/tags/list") {
			return false
		}
		body, link, _ := strings.Cut(pages[r.URL.Query().Get("last")], "\n")
		if link != "" {
			w.Header().Set("Link", link)
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, body)
		return true
	})
	got, err := f.open(t, "vm").(TagLister).ListTags(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var tags []string
	for _, g := range got {
		tags = append(tags, g.Tag)
		if g.Descriptor.Digest != want[g.Tag] {
			t.Errorf("tag %s names %s, want %s", g.Tag, g.Descriptor.Digest, want[g.Tag])
		}
	}
	if !slices.Equal(tags, []string{"a", "b", "c"}) || f.count(http.MethodGet, "/tags/list") != 3 {
		t.Fatalf("tags %v in %d pages", tags, f.count(http.MethodGet, "/tags/list"))
	}

	// A link elsewhere is refused: credentials go to this registry only.
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if !strings.HasSuffix(r.URL.Path, "/tags/list") {
			return false
		}
		w.Header().Set("Link", `<https://elsewhere.example/v2/vm/tags/list?last=a>; rel="next"`)
		fmt.Fprint(w, `{"name":"vm","tags":["a"]}`)
		return true
	})
	if _, err := f.open(t, "vm").(TagLister).ListTags(context.Background()); errcode.Of(err) != errcode.InvalidInput {
		t.Fatalf("a link to another host: %v, want INVALID_INPUT", err)
	}
	// So is an answer over the page limit.
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if !strings.HasSuffix(r.URL.Path, "/tags/list") {
			return false
		}
		fmt.Fprint(w, `{"name":"vm","tags":["`+strings.Repeat("a", maxTagPage)+`"]}`)
		return true
	})
	if _, err := f.open(t, "vm").(TagLister).ListTags(context.Background()); errcode.Of(err) != errcode.InvalidInput {
		t.Fatalf("an oversized page: %v, want INVALID_INPUT", err)
	}
}

// TestRegistryDeleteManifest: a deleted manifest no longer resolves (and
// deleting it again is fine); a registry answering 405 is told apart.
func TestRegistryDeleteManifest(t *testing.T) {
	f := newFakeRegistry(t)
	repo := f.open(t, "vm:disk")
	descs, datas := testChunks(t, 1, 1024)
	putChunks(t, repo, descs, datas)
	desc := pushDisk(t, repo, descs, nil)
	ctx := context.Background()
	if _, err := repo.(DigestResolver).ResolveDigest(ctx, desc.Digest); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := repo.(ManifestDeleter).DeleteManifest(ctx, desc.Digest); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := repo.(DigestResolver).ResolveDigest(ctx, desc.Digest); !errors.Is(err, ErrNotFound) || errcode.Of(err) != errcode.RegistryError {
		t.Fatalf("a deleted manifest resolves: %v", err)
	}
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method != http.MethodDelete {
			return false
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusMethodNotAllowed)
		fmt.Fprint(w, `{"errors":[{"code":"UNSUPPORTED","message":"The operation is unsupported."}]}`)
		return true
	})
	err := repo.(ManifestDeleter).DeleteManifest(ctx, desc.Digest)
	if !errors.Is(err, ErrDeletesDisabled) || errcode.Of(err) != errcode.RegistryError || !strings.Contains(err.Error(), "enable storage.delete") {
		t.Fatalf("405: %v", err)
	}
	if n := f.count(http.MethodDelete, "/manifests/"); n != 3 {
		t.Fatalf("%d DELETEs: a 405 must not be retried", n)
	}
}

// TestLayoutCollectGarbage: only blobs no listed manifest (or root) needs,
// and written before the cut-off, are removed; a shared blob stays.
func TestLayoutCollectGarbage(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	var repo Repository = openLayout(t, "oci:"+dir)
	descs, datas := testChunks(t, 3, 1024)
	putChunks(t, repo, descs, datas)
	keep := pushDisk(t, repo, descs[:2], nil)   // chunks 0, 1
	drop := pushDisk(t, repo, descs[1:], &keep) // chunks 1, 2; subject keep
	l := repo.(*Layout)
	if err := l.DeleteManifest(ctx, drop.Digest); err != nil {
		t.Fatal(err)
	}
	if _, err := l.ResolveDigest(ctx, drop.Digest); err != nil {
		t.Fatalf("before the collection the deleted manifest's blob is still there: %v", err)
	}
	// Blobs younger than the cut-off stay.
	if removed, err := l.CollectGarbage(ctx, time.Now().Add(-time.Hour), nil); err != nil || len(removed) != 0 {
		t.Fatalf("removed %v, %v: every blob is younger than the cut-off", removed, err)
	}
	removed, err := l.CollectGarbage(ctx, time.Now().Add(time.Second), nil)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(removed)
	want := []digest.Digest{drop.Digest, descs[2].Digest}
	slices.Sort(want)
	if !slices.Equal(removed, want) {
		t.Fatalf("removed %v, want the dropped manifest and its own chunk %v", removed, want)
	}
	for _, d := range []digest.Digest{keep.Digest, descs[0].Digest, descs[1].Digest} {
		if _, err := os.Stat(filepath.Join(dir, "blobs", "sha256", d.Encoded())); err != nil {
			t.Fatalf("blob %s of the kept manifest: %v", d, err)
		}
	}
	if _, err := l.ResolveDigest(ctx, drop.Digest); !errors.Is(err, ErrNotFound) {
		t.Fatalf("the collected manifest resolves: %v", err)
	}
	// A root not listed in index.json keeps what it names.
	if err := l.DeleteManifest(ctx, keep.Digest); err != nil {
		t.Fatal(err)
	}
	if removed, err := l.CollectGarbage(ctx, time.Now().Add(time.Second), []digest.Digest{keep.Digest}); err != nil || len(removed) != 0 {
		t.Fatalf("removed %v, %v; the root names them all", removed, err)
	}
}
