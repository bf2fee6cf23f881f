package imgcrypt

import (
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// testConfig is a state image's config as the tests write it.
type testConfig struct {
	Machine string `json:"machine"`
	Memory  int64  `json:"memory"`
}

// openLayout opens the layout ref names as stored: no encryption.
func openLayout(t *testing.T, ref string) *ociimage.Layout {
	t.Helper()
	return openRef(t, ref).(*ociimage.Layout)
}

// openRef opens the repository ref names with opts.
func openRef(t *testing.T, ref string, opts ...ociimage.Option) ociimage.Repository {
	t.Helper()
	r, err := ociimage.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	repo, err := ociimage.Open(t.Context(), r, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return repo
}

func wantCode(t *testing.T, err error, code errcode.Code, contains string) {
	t.Helper()
	if errcode.Of(err) != code {
		t.Fatalf("got %v (code %q), want %s", err, errcode.Of(err), code)
	}
	if !strings.Contains(err.Error(), contains) {
		t.Fatalf("error %q does not say %q", err, contains)
	}
}
