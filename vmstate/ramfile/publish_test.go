package ramfile

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

// fillFile puts a complete file of size bytes (all b) under key.
func fillFile(t *testing.T, c Cache, key digest.Digest, size int, b byte) string {
	t.Helper()
	p, _, err := c.Fill(context.Background(), key, int64(size), func(f *os.File) (int64, error) {
		n, err := f.Write([]byte(strings.Repeat(string(b), size)))
		return int64(n), err
	})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestPublishLinksTheFileAndEvictionSparesIt(t *testing.T) {
	c := Cache{Dir: filepath.Join(t.TempDir(), "cache")}
	a, b := digest.FromString("a"), digest.FromString("b")
	pa := fillFile(t, c, a, 1<<16, 'a')
	fillFile(t, c, b, 1<<16, 'b')
	// a is the older one, so the first a size bound would evict.
	old := time.Now().Add(-time.Hour)
	if err := os.Chtimes(pa, old, old); err != nil {
		t.Fatal(err)
	}
	dir, err := c.Publish("csi-1", a, 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	linked := filepath.Join(dir, filepath.Base(pa))
	if !sameFile(pa, linked) {
		t.Fatal("the publication does not hold the cache's file itself")
	}
	// Publishing again is a no-op.
	if again, err := c.Publish("csi-1", a, 1<<16); err != nil || again != dir {
		t.Fatalf("second publish: %q %v", again, err)
	}
	// Under pressure (a bound of one byte) and age (a minute), only the
	// unpublished file goes.
	removed, err := c.Evict(1, time.Minute, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(removed) != 1 || removed[0].Key != b {
		t.Fatalf("evicted %v, want only %s", removed, b)
	}
	if _, err := os.Stat(pa); err != nil {
		t.Fatalf("the published file was evicted: %v", err)
	}
	entries, _ := c.List()
	if len(entries) != 1 || !entries[0].Published {
		t.Fatalf("list after eviction: %+v", entries)
	}
	// Unpublished, it goes at the next eviction; the pod's link went first,
	// so no publication ever shows a removed file.
	if err := c.Unpublish("csi-1"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("the publication is still there: %v", err)
	}
	if err := c.Unpublish("csi-1"); err != nil {
		t.Fatalf("unpublishing twice: %v", err)
	}
	if removed, err := c.Evict(1, 0, ""); err != nil || len(removed) != 1 || removed[0].Key != a {
		t.Fatalf("after unpublish evicted %v %v", removed, err)
	}
}

// Eviction by age leaves recently used files, whatever the size bound.
func TestEvictByAge(t *testing.T) {
	c := Cache{Dir: filepath.Join(t.TempDir(), "cache")}
	a, b := digest.FromString("a"), digest.FromString("b")
	pa := fillFile(t, c, a, 4096, 'a')
	fillFile(t, c, b, 4096, 'b')
	old := time.Now().Add(-2 * time.Hour)
	if err := os.Chtimes(pa, old, old); err != nil {
		t.Fatal(err)
	}
	removed, err := c.Evict(0, time.Hour, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(removed) != 1 || removed[0].Key != a {
		t.Fatalf("evicted %v, want only the file unused for 2h", removed)
	}
}

func TestPublishRefuses(t *testing.T) {
	c := Cache{Dir: filepath.Join(t.TempDir(), "cache")}
	a, b := digest.FromString("a"), digest.FromString("b")
	fillFile(t, c, a, 4096, 'a')
	fillFile(t, c, b, 4096, 'b')
	for _, name := range []string{"", "..", "../x", "a/b", "UPPER", strings.Repeat("x", 129)} {
		if _, err := c.Publish(name, a, 4096); err == nil {
			t.Errorf("publication name %q accepted", name)
		}
	}
	// A file the cache does not hold, or not complete at that size.
	if _, err := c.Publish("csi-2", digest.FromString("c"), 4096); err == nil {
		t.Error("published a file the cache lacks")
	}
	if _, err := c.Publish("csi-2", a, 8192); err == nil {
		t.Error("published a file of another size")
	}
	// A name in use for another image.
	if _, err := c.Publish("csi-3", a, 4096); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Publish("csi-3", b, 4096); err == nil {
		t.Error("a second image published under a name in use")
	}
}
