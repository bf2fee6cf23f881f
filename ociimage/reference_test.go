package ociimage

import (
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

const testHex = "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"

func TestParseReference(t *testing.T) {
	dg := digest.Digest("sha256:" + testHex)
	good := []struct {
		in   string
		want Reference
	}{
		{"oci:snap", Reference{Layout: "snap"}},
		{"oci:/var/lib/vmsnap/web:before-upgrade", Reference{Layout: "/var/lib/vmsnap/web", Tag: "before-upgrade"}},
		{"oci:./rel/dir:v1.2_3", Reference{Layout: "./rel/dir", Tag: "v1.2_3"}},
		{"oci:./a:b/c", Reference{Layout: "./a:b/c"}}, // ':' inside the directory
		{"oci:./a:b/c:t", Reference{Layout: "./a:b/c", Tag: "t"}},
		{"oci:/x@y/z", Reference{Layout: "/x@y/z"}}, // '@' inside the directory
		{"oci:/snaps/web@sha256:" + testHex, Reference{Layout: "/snaps/web", Digest: dg}},
		{"oci:d:_" + strings.Repeat("a", 127), Reference{Layout: "d", Tag: "_" + strings.Repeat("a", 127)}},
		{"registry.example.com/vms/web:v1", Reference{Registry: "registry.example.com", Repository: "vms/web", Tag: "v1"}},
		{"localhost:5000/web", Reference{Registry: "localhost:5000", Repository: "web"}},
		{"localhost/a/b-c/d__e", Reference{Registry: "localhost", Repository: "a/b-c/d__e"}},
		{"10.0.0.1:5000/web@sha256:" + testHex, Reference{Registry: "10.0.0.1:5000", Repository: "web", Digest: dg}},
		{"[::1]:5000/web:latest", Reference{Registry: "[::1]:5000", Repository: "web", Tag: "latest"}},
	}
	for _, c := range good {
		got, err := ParseReference(c.in)
		if err != nil {
			t.Errorf("ParseReference(%q): %v", c.in, err)
			continue
		}
		if got != c.want {
			t.Errorf("ParseReference(%q) = %+v, want %+v", c.in, got, c.want)
		}
		if got.String() != c.in {
			t.Errorf("ParseReference(%q).String() = %q", c.in, got.String())
		}
		if got.IsLayout() != strings.HasPrefix(c.in, "oci:") {
			t.Errorf("ParseReference(%q).IsLayout() = %v", c.in, got.IsLayout())
		}
		if got.IsDigest() != (c.want.Digest != "") {
			t.Errorf("ParseReference(%q).IsDigest() = %v", c.in, got.IsDigest())
		}
	}

	bad := []string{
		"",
		"oci:",
		"oci::tag",
		"oci:@sha256:" + testHex,
		"oci:dir:",
		"oci:dir:-tag",
		"oci:dir:.tag",
		"oci:dir:tag!",
		"oci:dir:" + strings.Repeat("a", 129),
		"oci:dir@sha256:abc", // short hex
		"oci:dir@sha512:" + strings.Repeat("a", 128), // not sha256
		"oci:dir@latest",
		"oci:dir:tag@sha256:" + testHex, // both
		"ubuntu",
		"ubuntu:22.04",
		"library/ubuntu",
		"registry.example.com",
		"registry.example.com/",
		"registry.example.com/Vms/web",
		"registry.example.com/vms//web",
		"registry.example.com/vms/web/",
		"registry.example.com/-web",
		"registry.example.com/web:",
		"registry.example.com/web:v1@sha256:" + testHex,
		"registry.example.com/web@sha256:" + testHex[:10],
		"bad_host.example.com/web",
		"registry.example.com:port/web",
		"registry.example.com/" + strings.Repeat("a", 250),
		"docker://registry.example.com/web",
	}
	for _, in := range bad {
		r, err := ParseReference(in)
		if err == nil {
			t.Errorf("ParseReference(%q) = %+v, want an error", in, r)
			continue
		}
		if errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("ParseReference(%q): code %s, want INVALID_INPUT: %v", in, errcode.Of(err), err)
		}
	}
}

func TestParseReferenceErrorShowsForms(t *testing.T) {
	_, err := ParseReference("ubuntu")
	if err == nil || !strings.Contains(err.Error(), "oci:DIR") {
		t.Fatalf("error %v does not show the accepted forms", err)
	}
}

func TestWithDigest(t *testing.T) {
	dg := digest.Digest("sha256:" + testHex)
	for in, want := range map[string]string{
		"oci:/snaps/web:v1":           "oci:/snaps/web@" + dg.String(),
		"oci:/snaps/web":              "oci:/snaps/web@" + dg.String(),
		"registry.example.com/web:v1": "registry.example.com/web@" + dg.String(),
	} {
		r, err := ParseReference(in)
		if err != nil {
			t.Fatal(err)
		}
		p := r.WithDigest(dg)
		if p.Tag != "" || p.Digest != dg || !p.IsDigest() {
			t.Errorf("%s.WithDigest = %+v", in, p)
		}
		if p.String() != want {
			t.Errorf("%s.WithDigest = %s, want %s", in, p, want)
		}
		back, err := ParseReference(p.String())
		if err != nil || back != p {
			t.Errorf("pinned %s does not parse back: %+v, %v", p, back, err)
		}
		if r.IsDigest() {
			t.Errorf("WithDigest changed its receiver")
		}
	}
}

func TestOpenPicksTheImplementation(t *testing.T) {
	r, err := ParseReference("registry.example.com/web:v1")
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("DOCKER_CONFIG", t.TempDir())
	repo, err := Open(t.Context(), r)
	if _, ok := repo.(*Registry); !ok || err != nil {
		t.Fatalf("Open(registry) = %T, %v, want a *Registry (and no request yet)", repo, err)
	}
	if _, err := Open(t.Context(), Reference{}); errcode.Of(err) != errcode.InvalidInput {
		t.Fatalf("Open(zero Reference) = %v, want INVALID_INPUT", err)
	}
}
