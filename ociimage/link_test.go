package ociimage

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

const linkDigest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

func mustRef(t *testing.T, s string) Reference {
	t.Helper()
	r, err := ParseReference(s)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// A link names a repository of the same registry by its path, a layout
// beside the checkpoint's by its name, and resolves back to it from
// wherever the checkpoint is read; nothing else can be linked.
func TestRelativeLinkRoundTrip(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct{ from, to, link, movedFrom, movedTo string }{
		{"reg.example:5000/vms/state:t", "REG.example:5000/vms/disk@" + linkDigest, "vms/disk@" + linkDigest,
			"mirror.example/vms/state", "mirror.example/vms/disk@" + linkDigest},
		{"reg.example/a/b/state", "reg.example/c@" + linkDigest, "c@" + linkDigest, "10.0.0.1:5000/a/b/state", "10.0.0.1:5000/c@" + linkDigest},
		{"oci:" + dir + "/snaps/vm1:t", "oci:" + dir + "/snaps/vm1-disk@" + linkDigest, "vm1-disk@" + linkDigest,
			"oci:" + dir + "/copy/vm1", "oci:" + filepath.Join(dir, "copy", "vm1-disk") + "@" + linkDigest},
	} {
		link, err := RelativeLink(mustRef(t, c.from), mustRef(t, c.to))
		if err != nil || link != c.link {
			t.Fatalf("%s -> %s: %q, %v; want %q", c.from, c.to, link, err, c.link)
		}
		got, err := ResolveLink(mustRef(t, c.movedFrom), link)
		if err != nil || got.String() != c.movedTo {
			t.Fatalf("%q read from %s: %s, %v; want %s", link, c.movedFrom, got, err, c.movedTo)
		}
	}
	for _, c := range []struct{ from, to string }{
		{"reg.example/vms/state", "other.example/vms/disk@" + linkDigest},
		{"reg.example/vms/state", "oci:" + dir + "/disk@" + linkDigest},
		{"oci:" + dir + "/state", "reg.example/vms/disk@" + linkDigest},
		{"oci:" + dir + "/a/state", "oci:" + dir + "/b/disk@" + linkDigest},
		{"oci:" + dir + "/state", "oci:" + dir + "/state/disk@" + linkDigest},
	} {
		_, err := RelativeLink(mustRef(t, c.from), mustRef(t, c.to))
		if errcode.Of(err) != errcode.Usage || !strings.Contains(err.Error(), "so that a copy keeps the link") {
			t.Errorf("%s -> %s: %v, want USAGE", c.from, c.to, err)
		}
	}
}

// ResolveLink refuses every link that could lead off the registry (or out
// of the layouts' directory) it is read from.
func TestResolveLinkRefusesEscapes(t *testing.T) {
	reg, lay := mustRef(t, "reg.example/vms/state"), mustRef(t, "oci:/srv/snaps/vm1")
	for _, c := range []struct {
		base Reference
		link string
	}{
		{reg, "evil.example:443/vms/disk@" + linkDigest},
		{reg, "vms/../disk@" + linkDigest},
		{reg, "Vms/disk@" + linkDigest},
		{reg, "vms/disk:t@" + linkDigest},
		{reg, "/vms/disk@" + linkDigest},
		{reg, "vms/disk"},
		{reg, "vms/disk@md5:abc"},
		{lay, "..@" + linkDigest},
		{lay, ".@" + linkDigest},
		{lay, "../etc@" + linkDigest},
		{lay, "/etc@" + linkDigest},
		{lay, "a/b@" + linkDigest},
		{lay, "@" + linkDigest},
	} {
		if got, err := ResolveLink(c.base, c.link); errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("%q from %s: %s, %v; want INVALID_INPUT", c.link, c.base, got, err)
		}
	}
	// A path that looks like a host is a repository of the base registry.
	got, err := ResolveLink(reg, "evil.example/vms@"+linkDigest)
	if err != nil || got.Registry != "reg.example" || got.Repository != "evil.example/vms" {
		t.Fatalf("a host-like first component: %+v, %v", got, err)
	}
}

// A link of a checkpoint from before the index names a host; it is
// resolved against the registry the checkpoint is read from, never
// followed to that host; a layout only to itself or a layout beside it.
func TestLegacyLinksResolveWhereTheyAreRead(t *testing.T) {
	for _, c := range []struct{ base, link, want string }{
		{"mirror.example/vms/vm1@" + linkDigest, "127.0.0.1:38361/vms/disk@" + linkDigest, "mirror.example/vms/disk@" + linkDigest},
		{"oci:/srv/snaps/vm1@" + linkDigest, "oci:/srv/snaps/vm1@" + linkDigest, "oci:/srv/snaps/vm1@" + linkDigest},
		{"oci:/srv/snaps/vm1@" + linkDigest, "oci:/srv/snaps/disk@" + linkDigest, "oci:/srv/snaps/disk@" + linkDigest},
	} {
		got, err := resolveLegacyLink(mustRef(t, c.base), c.link)
		if err != nil || got.String() != c.want {
			t.Errorf("%s from %s: %s, %v; want %s", c.link, c.base, got, err, c.want)
		}
	}
	for _, c := range []struct{ base, link string }{
		{"oci:/srv/snaps/vm1", "oci:/etc/x@" + linkDigest},
		{"oci:/srv/snaps/vm1", "reg.example/vms/disk@" + linkDigest},
		{"reg.example/vms/vm1", "oci:/srv/x@" + linkDigest},
		{"reg.example/vms/vm1", "reg.example/vms/disk:tag"},
	} {
		if got, err := resolveLegacyLink(mustRef(t, c.base), c.link); err == nil {
			t.Errorf("%s from %s resolved to %s", c.link, c.base, got)
		}
	}
}
