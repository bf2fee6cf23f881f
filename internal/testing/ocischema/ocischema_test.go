package ocischema

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

const (
	dgst     = "sha256:6c3c624b58dbbcd3c0dd82b4c53f04194d1247c6eebdaab7c610cf7d66709b3b"
	manifest = `{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","artifactType":"application/vnd.vmsnap.vmstate.v1",` +
		`"config":{"mediaType":"application/vnd.vmsnap.vmstate.config.v1+json","digest":"` + dgst + `","size":3},` +
		`"layers":[{"mediaType":"application/vnd.vmsnap.chunk.v1.raw+zstd","digest":"` + dgst + `","size":3}]}`
)

// The schemas refuse what the spec forbids: each case would pass a
// validator that checked nothing.
func TestValidateRefusesWhatTheSchemaForbids(t *testing.T) {
	if err := Validate(ocispec.MediaTypeImageManifest, []byte(manifest)); err != nil {
		t.Fatalf("a well-formed manifest: %v", err)
	}
	for name, c := range map[string]struct{ mediaType, doc string }{
		"manifest schemaVersion 1": {ocispec.MediaTypeImageManifest, strings.Replace(manifest, `"schemaVersion":2`, `"schemaVersion":1`, 1)},
		"manifest without layers": {ocispec.MediaTypeImageManifest, `{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",` +
			`"config":{"mediaType":"a/b","digest":"` + dgst + `","size":3},"layers":[]}`},
		"manifest with a bad digest":  {ocispec.MediaTypeImageManifest, strings.Replace(manifest, dgst, "sha256-no-colon", 1)},
		"manifest with a bad type":    {ocispec.MediaTypeImageManifest, strings.Replace(manifest, "application/vnd.vmsnap.vmstate.v1", "not a media type", 1)},
		"index entry without a size":  {ocispec.MediaTypeImageIndex, `{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"` + dgst + `"}]}`},
		"index annotation not a text": {ocispec.MediaTypeImageIndex, `{"schemaVersion":2,"manifests":[],"annotations":{"a":1}}`},
		"config with a bad env":       {ocispec.MediaTypeImageConfig, `{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]},"config":{"Env":["NOEQUALS"]}}`},
		"layout of another version":   {ocispec.MediaTypeLayoutHeader, `{"imageLayoutVersion":2}`},
	} {
		if err := Validate(c.mediaType, []byte(c.doc)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if err := Validate("application/vnd.vmsnap.vmstate.config.v1+json", []byte(`{}`)); err == nil {
		t.Error("a media type without a schema passed")
	}
}

// Layout walks index.json down to every manifest, and refuses a blob whose
// bytes are not its digest's.
func TestLayoutWalksEveryManifest(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	d := sha(manifest)
	write("oci-layout", `{"imageLayoutVersion":"1.0.0"}`)
	write("blobs/sha256/"+strings.TrimPrefix(d, "sha256:"), manifest)
	write("index.json", `{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[`+
		`{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"`+d+`","size":`+itoa(len(manifest))+`}]}`)
	checked, err := Layout(context.Background(), dir)
	if err != nil || checked[ocispec.MediaTypeImageManifest] != 1 {
		t.Fatalf("checked %v, %v", checked, err)
	}
	write("blobs/sha256/"+strings.TrimPrefix(d, "sha256:"), strings.Replace(manifest, "zstd", "zstx", 1))
	if _, err := Layout(context.Background(), dir); err == nil || !strings.Contains(err.Error(), "digest") {
		t.Fatalf("a corrupt manifest: %v", err)
	}
}

func sha(s string) string { return digest.FromString(s).String() }

func itoa(n int) string { return strconv.Itoa(n) }
