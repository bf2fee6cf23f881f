package ociimage

// Adversarial layouts: index.json, manifests and configs crafted by someone
// else, read through Layout and PullArtifact. Every refusal must carry a
// clear code (never INTERNAL, never a panic), and reading must write nothing,
// inside the layout or outside it.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// fuzzConfig is a config with the shape of vmstate.Config's top level, so
// that seeds look like what vmsnap writes.
type fuzzConfig struct {
	Record      map[string]any `json:"record"`
	Mode        string         `json:"mode"`
	RawBytes    int64          `json:"rawBytes"`
	Compression string         `json:"compression"`
	ChunkSize   int            `json:"chunkSize"`
}

// realLayout pushes a real VM-state-like artifact (zstd chunks, the
// annotations vmsnap writes) into DIR with PushArtifact and returns the raw
// index.json, manifest and config bytes that were written, for seeds.
func realLayout(tb testing.TB, dir string) (index, manifest, config []byte) {
	tb.Helper()
	ctx := context.Background()
	r, err := ParseReference("oci:" + dir + ":vm")
	if err != nil {
		tb.Fatal(err)
	}
	repo, err := Open(ctx, r)
	if err != nil {
		tb.Fatal(err)
	}
	enc, _ := zstd.NewWriter(nil)
	defer enc.Close()
	var layers []ocispec.Descriptor
	var off int64
	for i, raw := range [][]byte{bytes.Repeat([]byte("vmstate"), 1000), []byte("the tail of the stream")} {
		c := enc.EncodeAll(raw, nil)
		d := ocispec.Descriptor{MediaType: MediaTypeChunk, Digest: digest.FromBytes(c), Size: int64(len(c)),
			Annotations: map[string]string{AnnotationRawSize: strconv.Itoa(len(raw)), AnnotationRawOffset: strconv.FormatInt(off, 10)}}
		if err := repo.PutBlob(ctx, d, c); err != nil {
			tb.Fatalf("chunk %d: %v", i, err)
		}
		off += int64(len(raw))
		layers = append(layers, d)
	}
	desc, err := pushTagged(ctx, repo, Artifact{
		ArtifactType: ArtifactTypeVMState, ConfigMediaType: MediaTypeVMStateConfig,
		Config: fuzzConfig{Record: map[string]any{"qemuVersion": "7.2.22", "arch": "x86_64"}, Mode: "pause", RawBytes: off, Compression: "zstd", ChunkSize: 4 << 20},
		Layers: layers, Annotations: map[string]string{AnnotationMode: "pause", AnnotationCreated: time.Unix(0, 0).UTC().Format(time.RFC3339)},
	})
	if err != nil {
		tb.Fatal(err)
	}
	read := func(p string) []byte {
		b, err := os.ReadFile(p)
		if err != nil {
			tb.Fatal(err)
		}
		return b
	}
	manifest = read(filepath.Join(dir, "blobs", "sha256", desc.Digest.Encoded()))
	var m ocispec.Manifest
	if err := json.Unmarshal(manifest, &m); err != nil {
		tb.Fatal(err)
	}
	config = read(filepath.Join(dir, "blobs", "sha256", m.Config.Digest.Encoded()))
	return read(filepath.Join(dir, "index.json")), manifest, config
}

// treeState records every path below root with its type, size and mtime.
func treeState(tb testing.TB, root string) map[string]string {
	tb.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		size := fi.Size()
		if fi.IsDir() {
			size = 0 // a directory's size changes with its entries; the entries are listed anyway
		}
		out[p] = fmt.Sprintf("%s %d %d", fi.Mode(), size, fi.ModTime().UnixNano())
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
	return out
}

func sameTree(tb testing.TB, before, after map[string]string) {
	tb.Helper()
	for p, s := range after {
		if b, ok := before[p]; !ok {
			tb.Errorf("reading wrote %s", p)
		} else if b != s {
			tb.Errorf("reading changed %s: %s -> %s", p, b, s)
		}
	}
	for p := range before {
		if _, ok := after[p]; !ok {
			tb.Errorf("reading removed %s", p)
		}
	}
}

// readCodes are the codes a read of a hostile layout may fail with.
var readCodes = map[errcode.Code]bool{errcode.InvalidInput: true, errcode.DigestMismatch: true, errcode.RegistryError: true}

func wantReadCode(tb testing.TB, what string, err error) {
	tb.Helper()
	if err == nil {
		return
	}
	if !readCodes[errcode.Of(err)] {
		tb.Fatalf("%s: %v (code %s), want INVALID_INPUT, DIGEST_MISMATCH or REGISTRY_ERROR", what, err, errcode.Of(err))
	}
}

// Placeholders the fuzzer may move around in its templates; each is
// replaced by the digest or size of the blob written from the other inputs,
// so that mutations keep reaching the checks behind the digest lookup.
const (
	phManifest     = "@MANIFEST@"
	phManifestSize = "@MANIFEST_SIZE@"
	phConfig       = "@CONFIG@"
	phConfigSize   = "@CONFIG_SIZE@"
	phChunk        = "@CHUNK@"
	phChunkSize    = "@CHUNK_SIZE@"
)

// templated turns real bytes into a template by replacing what names one
// blob by its placeholder.
func templated(b []byte, repl ...string) []byte {
	return []byte(strings.NewReplacer(repl...).Replace(string(b)))
}

// FuzzLayoutPull writes a layout whose index.json, manifest and config are
// the fuzzer's (with placeholders for digests and sizes), then reads it the
// way restore does: PullArtifact by tag and by digest, and every blob the
// manifest names through Blob with the chunk limit.
func FuzzLayoutPull(f *testing.F) {
	seedDir := f.TempDir()
	index, manifest, config := realLayout(f, seedDir)
	var m ocispec.Manifest
	json.Unmarshal(manifest, &m)
	var idx ocispec.Index
	json.Unmarshal(index, &idx)
	chunk, _ := os.ReadFile(filepath.Join(seedDir, "blobs", "sha256", m.Layers[0].Digest.Encoded()))
	mDesc := idx.Manifests[0]
	rIndex := []string{string(mDesc.Digest), phManifest, `"size":` + strconv.FormatInt(mDesc.Size, 10), `"size":` + phManifestSize}
	rManifest := []string{
		string(m.Config.Digest), phConfig, `"size":` + strconv.FormatInt(m.Config.Size, 10), `"size":` + phConfigSize,
		string(m.Layers[0].Digest), phChunk, `"size":` + strconv.FormatInt(m.Layers[0].Size, 10), `"size":` + phChunkSize,
	}
	tIndex, tManifest := templated(index, rIndex...), templated(manifest, rManifest...)
	f.Add(tIndex, tManifest, config, chunk, "vm")
	f.Add(index, manifest, config, chunk, "vm") // the real thing, untemplated
	// Hand-written variants of the attacks the fuzzer should start from.
	for _, mut := range [][2]string{
		{`"mediaType":"application/vnd.oci.image.manifest.v1+json"`, `"mediaType":"application/vnd.oci.image.index.v1+json"`},
		{ArtifactTypeVMState, ArtifactTypeDisk},
		{`"size":` + phChunkSize, `"size":-1`},
		{`"size":` + phChunkSize, `"size":9223372036854775807`},
		{`"size":` + phConfigSize, `"size":1099511627776`},
		{phChunk, "sha256:../../../../etc/passwd"},
		{phConfig, "sha256:" + strings.Repeat("0", 64) + "/../../../x"},
		{phConfig, "sha512:" + strings.Repeat("a", 128)},
		{`"schemaVersion":2`, `"schemaVersion":-2`},
	} {
		f.Add(tIndex, []byte(strings.Replace(string(tManifest), mut[0], mut[1], 1)), config, chunk, "vm")
	}
	f.Add([]byte(`{"schemaVersion":2,"manifests":[{"digest":"sha256:../../x","size":1}]}`), tManifest, config, chunk, "vm")
	f.Add([]byte(`{"schemaVersion":2,"manifests":null}`), tManifest, config, chunk, "vm")
	f.Add([]byte(`[]`), tManifest, config, chunk, "vm")
	f.Add([]byte{0xff, 0xfe, 0}, tManifest, config, chunk, "../../etc")
	f.Add(tIndex, tManifest, []byte(`{"record":{},"mode":"pause","rawBytes":1,"surprise":true}`), chunk, "vm")
	f.Add(tIndex, tManifest, []byte(`{"record":{}} {"second":1}`), chunk, "vm")

	f.Fuzz(func(t *testing.T, indexT, manifestT, configB, chunkB []byte, tag string) {
		root := t.TempDir()
		dir := filepath.Join(root, "layout")
		blobs := filepath.Join(dir, "blobs", "sha256")
		if err := os.MkdirAll(blobs, 0o755); err != nil {
			t.Fatal(err)
		}
		write := func(p string, b []byte) {
			if err := os.WriteFile(p, b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		put := func(b []byte) digest.Digest {
			d := digest.FromBytes(b)
			write(filepath.Join(blobs, d.Encoded()), b)
			return d
		}
		write(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`))
		cd, xd := put(configB), put(chunkB)
		manifestB := []byte(strings.NewReplacer(
			phConfigSize, strconv.Itoa(len(configB)), phConfig, string(cd),
			phChunkSize, strconv.Itoa(len(chunkB)), phChunk, string(xd),
		).Replace(string(manifestT)))
		md := put(manifestB)
		write(filepath.Join(dir, "index.json"), []byte(strings.NewReplacer(
			phManifestSize, strconv.Itoa(len(manifestB)), phManifest, string(md),
		).Replace(string(indexT))))
		write(filepath.Join(root, "sentinel"), []byte("outside the layout"))
		before := treeState(t, root)

		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		refs := []string{"oci:" + dir + "@" + string(md)}
		// The tag is the fuzzer's too; one with path characters either
		// fails to parse or names another directory, never a file inside
		// this one.
		if ref, err := ParseReference("oci:" + dir + ":" + tag); err == nil {
			if ref.Layout != dir && !strings.HasPrefix(ref.Layout, dir+":") {
				t.Fatalf("tag %q moved the layout to %q", tag, ref.Layout)
			}
			refs = append(refs, "oci:"+dir+":"+tag)
		} else if errcode.Of(err) != errcode.InvalidInput {
			t.Fatalf("ParseReference with tag %q: %v (code %s)", tag, err, errcode.Of(err))
		}
		for _, s := range refs {
			ref, err := ParseReference(s)
			if err != nil {
				t.Fatalf("ParseReference(%q): %v", s, err)
			}
			repo, err := Open(ctx, ref)
			if err != nil {
				t.Fatal(err)
			}
			var cfg fuzzConfig
			desc, man, err := PullArtifact(ctx, repo, ArtifactTypeVMState, &cfg)
			wantReadCode(t, "PullArtifact "+s, err)
			if _, terr := repo.(*Layout).Tags(ctx); terr != nil {
				wantReadCode(t, "Tags", terr)
			}
			if err != nil {
				continue
			}
			// What PullArtifact accepts is what vmsnap can read safely.
			if man.ArtifactType != ArtifactTypeVMState || man.Config.MediaType != MediaTypeVMStateConfig || desc.Digest == "" {
				t.Fatalf("PullArtifact accepted %+v", man)
			}
			for i, l := range man.Layers {
				if l.MediaType != MediaTypeChunk || l.Size < 0 || l.Size > MaxChunkSize {
					t.Fatalf("PullArtifact accepted layer %d %+v", i, l)
				}
				b, err := repo.Blob(ctx, l, MaxChunkSize)
				wantReadCode(t, fmt.Sprintf("layer %d", i), err)
				if err == nil && (int64(len(b)) != l.Size || digest.FromBytes(b) != l.Digest) {
					t.Fatalf("Blob returned unverified bytes for layer %d", i)
				}
			}
			if _, err := repo.Referrers(ctx, desc); err != nil {
				wantReadCode(t, "Referrers", err)
			}
		}
		sameTree(t, before, treeState(t, root))
	})
}

// TestLayoutRefusesCraftedImages: one table case per attack, each with the
// code it must get.
func TestLayoutRefusesCraftedImages(t *testing.T) {
	seedDir := t.TempDir()
	index, manifest, config := realLayout(t, seedDir)
	var real ocispec.Manifest
	if err := json.Unmarshal(manifest, &real); err != nil {
		t.Fatal(err)
	}
	chunk, _ := os.ReadFile(filepath.Join(seedDir, "blobs", "sha256", real.Layers[0].Digest.Encoded()))
	_ = index

	type layoutEdit struct {
		manifest func(m map[string]any) // edits the manifest JSON
		rawMan   func([]byte) []byte    // or replaces its bytes
		config   []byte                 // replaces the config blob
		index    func(md digest.Digest, size int) []byte
		tag      string // the tag to pull by (default vm)
		byDigest bool   // pull by the manifest's digest instead
	}
	layer := func(m map[string]any, i int) map[string]any { return m["layers"].([]any)[i].(map[string]any) }
	cases := []struct {
		name string
		edit layoutEdit
		code errcode.Code
		says string
	}{
		{"real image reads", layoutEdit{}, "", ""},
		{"manifest media type is an index", layoutEdit{manifest: func(m map[string]any) { m["mediaType"] = ocispec.MediaTypeImageIndex }}, errcode.InvalidInput, "media type"},
		{"manifest media type missing", layoutEdit{manifest: func(m map[string]any) { delete(m, "mediaType") }}, errcode.InvalidInput, "media type"},
		{"docker schema 2 media type", layoutEdit{manifest: func(m map[string]any) { m["mediaType"] = "application/vnd.docker.distribution.manifest.v2+json" }}, errcode.InvalidInput, "media type"},
		{"wrong artifactType", layoutEdit{manifest: func(m map[string]any) { m["artifactType"] = ArtifactTypeDisk }}, errcode.InvalidInput, "disk image"},
		{"no artifactType", layoutEdit{manifest: func(m map[string]any) { delete(m, "artifactType") }}, errcode.InvalidInput, "not a VM state image"},
		{"wrong config media type", layoutEdit{manifest: func(m map[string]any) {
			m["config"].(map[string]any)["mediaType"] = "application/vnd.oci.image.config.v1+json"
		}}, errcode.InvalidInput, "config of type"},
		{"layer media type gzip", layoutEdit{manifest: func(m map[string]any) { layer(m, 0)["mediaType"] = ocispec.MediaTypeImageLayerGzip }}, errcode.InvalidInput, "layer 0"},
		{"negative layer size", layoutEdit{manifest: func(m map[string]any) { layer(m, 0)["size"] = -1 }}, errcode.InvalidInput, "negative"},
		{"huge layer size", layoutEdit{manifest: func(m map[string]any) { layer(m, 1)["size"] = int64(1) << 62 }}, errcode.InvalidInput, "layer 1"},
		{"layer just over the chunk limit", layoutEdit{manifest: func(m map[string]any) { layer(m, 0)["size"] = MaxChunkSize + 1 }}, errcode.InvalidInput, "layer 0"},
		{"negative config size", layoutEdit{manifest: func(m map[string]any) { m["config"].(map[string]any)["size"] = -7 }}, errcode.InvalidInput, "negative"},
		{"huge config size", layoutEdit{manifest: func(m map[string]any) { m["config"].(map[string]any)["size"] = MaxConfigSize + 1 }}, errcode.InvalidInput, "outside"},
		{"config size lies", layoutEdit{manifest: func(m map[string]any) { m["config"].(map[string]any)["size"] = 3 }}, errcode.DigestMismatch, "corrupt"},
		{"traversal in layer digest", layoutEdit{manifest: func(m map[string]any) { layer(m, 0)["digest"] = "sha256:../../../../etc/passwd" }}, errcode.InvalidInput, "digest"},
		{"traversal in config digest", layoutEdit{manifest: func(m map[string]any) {
			m["config"].(map[string]any)["digest"] = "sha256:" + strings.Repeat("a", 64) + "/../../../../../etc/passwd"
		}}, errcode.InvalidInput, "digest"},
		{"uppercase digest", layoutEdit{manifest: func(m map[string]any) {
			m["config"].(map[string]any)["digest"] = strings.ToUpper(string(real.Config.Digest))
		}}, errcode.InvalidInput, "digest"},
		{"sha512 digest", layoutEdit{manifest: func(m map[string]any) { layer(m, 0)["digest"] = "sha512:" + strings.Repeat("a", 128) }}, errcode.InvalidInput, "sha256"},
		{"subject with traversal", layoutEdit{manifest: func(m map[string]any) {
			m["subject"] = map[string]any{"mediaType": ocispec.MediaTypeImageManifest, "digest": "sha256:../x", "size": 1}
		}}, errcode.InvalidInput, "subject"},
		{"schemaVersion 1", layoutEdit{manifest: func(m map[string]any) { m["schemaVersion"] = 1 }}, errcode.InvalidInput, "schemaVersion"},
		{"layers is an object", layoutEdit{manifest: func(m map[string]any) { m["layers"] = map[string]any{} }}, errcode.InvalidInput, "JSON"},
		{"manifest not JSON", layoutEdit{rawMan: func([]byte) []byte { return []byte("\x00\x01 not json") }}, errcode.InvalidInput, "not valid JSON"},
		{"manifest over 4 MiB", layoutEdit{rawMan: func(b []byte) []byte {
			return append(bytes.TrimRight(b, "}"), []byte(`,"pad":"`+strings.Repeat("x", MaxManifestSize)+`"}`)...)
		}}, errcode.InvalidInput, "outside"},
		// A missing or duplicated layer is for the stream decoder to judge
		// (vmstate tests it): the manifest itself is well formed.
		{"duplicate layers read", layoutEdit{manifest: func(m map[string]any) { m["layers"] = append(m["layers"].([]any), m["layers"].([]any)[0]) }}, "", ""},
		{"config with unknown field", layoutEdit{config: []byte(`{"record":{},"mode":"pause","fromTheFuture":1}`)}, errcode.InvalidInput, "fromTheFuture"},
		{"config with trailing data", layoutEdit{config: []byte(`{"record":{}} []`)}, errcode.InvalidInput, "after its JSON"},
		{"config not JSON", layoutEdit{config: []byte(`rawBytes=1`)}, errcode.InvalidInput, "config"},
		{"config of wrong types", layoutEdit{config: []byte(`{"rawBytes":"many"}`)}, errcode.InvalidInput, "config"},
		{"config over 1 MiB", layoutEdit{config: []byte(`{"mode":"` + strings.Repeat("p", MaxConfigSize) + `"}`)}, errcode.InvalidInput, "outside"},
		{"index garbage", layoutEdit{index: func(digest.Digest, int) []byte { return []byte("{{{{") }, tag: "vm"}, errcode.InvalidInput, "not valid JSON"},
		{"index is an array", layoutEdit{index: func(digest.Digest, int) []byte { return []byte("[]") }, tag: "vm"}, errcode.InvalidInput, "index.json"},
		{"index schemaVersion 1", layoutEdit{index: func(md digest.Digest, n int) []byte {
			return fmt.Appendf(nil, `{"schemaVersion":1,"manifests":[{"digest":%q,"size":%d,"annotations":{%q:"vm"}}]}`, md, n, AnnotationRefName)
		}, tag: "vm"}, errcode.InvalidInput, "schemaVersion"},
		{"index entry with traversal digest", layoutEdit{index: func(md digest.Digest, n int) []byte {
			return fmt.Appendf(nil, `{"schemaVersion":2,"manifests":[{"digest":"sha256:../../../x","size":%d,"annotations":{%q:"vm"}}]}`, n, AnnotationRefName)
		}, tag: "vm"}, errcode.InvalidInput, "invalid digest"},
		{"index entry with negative size", layoutEdit{index: func(md digest.Digest, n int) []byte {
			return fmt.Appendf(nil, `{"schemaVersion":2,"manifests":[{"digest":%q,"size":-1,"annotations":{%q:"vm"}}]}`, md, AnnotationRefName)
		}, tag: "vm"}, errcode.InvalidInput, "size"},
		{"index entry with huge size", layoutEdit{index: func(md digest.Digest, n int) []byte {
			return fmt.Appendf(nil, `{"schemaVersion":2,"manifests":[{"mediaType":%q,"digest":%q,"size":%d,"annotations":{%q:"vm"}}]}`, ocispec.MediaTypeImageManifest, md, int64(1)<<60, AnnotationRefName)
		}, tag: "vm"}, errcode.InvalidInput, "outside"},
		{"index entry of an index", layoutEdit{index: func(md digest.Digest, n int) []byte {
			return fmt.Appendf(nil, `{"schemaVersion":2,"manifests":[{"mediaType":%q,"digest":%q,"size":%d,"annotations":{%q:"vm"}}]}`, ocispec.MediaTypeImageIndex, md, n, AnnotationRefName)
		}, tag: "vm"}, errcode.InvalidInput, "not an image manifest"},
		{"tag names two manifests", layoutEdit{index: func(md digest.Digest, n int) []byte {
			other := digest.FromString("other")
			return fmt.Appendf(nil, `{"schemaVersion":2,"manifests":[{"digest":%q,"size":%d,"annotations":{%q:"vm"}},{"digest":%q,"size":1,"annotations":{%q:"vm"}}]}`, md, n, AnnotationRefName, other, AnnotationRefName)
		}, tag: "vm"}, errcode.RegistryError, "names 2 different manifests"},
		{"index over 16 MiB", layoutEdit{index: func(digest.Digest, int) []byte {
			return []byte(`{"schemaVersion":2,"pad":"` + strings.Repeat("x", MaxIndexSize) + `"}`)
		}, tag: "vm"}, errcode.InvalidInput, "larger than"},
		{"unknown tag", layoutEdit{tag: "nope"}, errcode.RegistryError, "no tag nope"},
		{"by digest, not in index", layoutEdit{index: func(digest.Digest, int) []byte { return []byte(`{"schemaVersion":2,"manifests":[]}`) }, byDigest: true}, "", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			dir := filepath.Join(root, "layout")
			blobs := filepath.Join(dir, "blobs", "sha256")
			os.MkdirAll(blobs, 0o755)
			put := func(b []byte) digest.Digest {
				d := digest.FromBytes(b)
				if err := os.WriteFile(filepath.Join(blobs, d.Encoded()), b, 0o644); err != nil {
					t.Fatal(err)
				}
				return d
			}
			os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644)
			for _, l := range real.Layers {
				b, _ := os.ReadFile(filepath.Join(seedDir, "blobs", "sha256", l.Digest.Encoded()))
				put(b)
			}
			_ = chunk
			cfg := config
			if tc.edit.config != nil {
				cfg = tc.edit.config
			}
			cd := put(cfg)
			var raw map[string]any
			json.Unmarshal(manifest, &raw)
			if tc.edit.config != nil {
				raw["config"].(map[string]any)["digest"] = string(cd)
				raw["config"].(map[string]any)["size"] = len(cfg)
			}
			if tc.edit.manifest != nil {
				tc.edit.manifest(raw)
			}
			mb, _ := json.Marshal(raw)
			if tc.edit.rawMan != nil {
				mb = tc.edit.rawMan(manifest)
			}
			md := put(mb)
			idx := fmt.Appendf(nil, `{"schemaVersion":2,"mediaType":%q,"manifests":[{"mediaType":%q,"digest":%q,"size":%d,"annotations":{%q:"vm"}}]}`,
				ocispec.MediaTypeImageIndex, ocispec.MediaTypeImageManifest, md, len(mb), AnnotationRefName)
			if tc.edit.index != nil {
				idx = tc.edit.index(md, len(mb))
			}
			os.WriteFile(filepath.Join(dir, "index.json"), idx, 0o644)
			before := treeState(t, root)

			ref := "oci:" + dir + "@" + string(md)
			if !tc.edit.byDigest {
				tag := tc.edit.tag
				if tag == "" {
					tag = "vm"
				}
				ref = "oci:" + dir + ":" + tag
			}
			var out fuzzConfig
			_, m, err := PullArtifact(t.Context(), openLayout(t, ref), ArtifactTypeVMState, &out)
			if tc.code == "" {
				if err != nil {
					t.Fatalf("%s: %v", ref, err)
				}
				if len(m.Layers) == 0 {
					t.Fatal("no layers")
				}
			} else {
				wantCode(t, err, tc.code, tc.says)
			}
			sameTree(t, before, treeState(t, root))
		})
	}
}

// TestParseDigestRefusesPaths: a digest names a file under blobs/sha256, so
// anything but 64 lowercase hex digits after "sha256:" must be refused.
func TestParseDigestRefusesPaths(t *testing.T) {
	hex := strings.Repeat("ab", 32)
	for _, s := range []string{
		"sha256:../../x", "sha256:../../../../../../etc/passwd", "sha256:" + hex + "/../../x", "sha256:/" + hex[1:],
		"sha256:" + hex + "/", "sha256:" + hex[:63] + ".", "sha256:" + strings.ToUpper(hex), "sha256:" + hex + "\x00",
		"sha256:" + hex + "\n", "sha256:" + hex[:63], "sha256:" + hex + "0", "sha256:", "sha256", ":" + hex, "",
		"sha512:" + hex + hex, "md5:" + hex[:32], "SHA256:" + hex, "sha256+b64:" + hex, "sha256:.." + hex[2:],
		"sha256:" + hex[:32] + "/" + hex[33:], "sha256:" + hex[:32] + "\\" + hex[33:],
	} {
		if d, err := ParseDigest(s); err == nil {
			t.Errorf("ParseDigest(%q) = %q, want an error", s, d)
		}
		// With a '/' after the '@' the whole string is a directory name
		// (oci:./a@b/c is the directory a@b/c), never a digest.
		if r, err := ParseReference("oci:/tmp/x@" + s); err == nil && r.Digest != "" {
			t.Errorf("ParseReference accepted digest %q as %q", s, r.Digest)
		}
		l := &Layout{dir: t.TempDir()}
		if _, err := l.HasBlob(t.Context(), digest.Digest(s)); errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("HasBlob(%q) = %v, want INVALID_INPUT", s, err)
		}
		if err := l.PutBlob(t.Context(), ocispec.Descriptor{Digest: digest.Digest(s), Size: 1}, []byte("x")); errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("PutBlob(%q) = %v, want INVALID_INPUT", s, err)
		}
		if _, err := l.Blob(t.Context(), ocispec.Descriptor{Digest: digest.Digest(s), Size: 1}, 10); errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("Blob(%q) = %v, want INVALID_INPUT", s, err)
		}
	}
}

// FuzzParseDigest: whatever ParseDigest accepts names a file directly in
// blobs/sha256, never a path elsewhere.
func FuzzParseDigest(f *testing.F) {
	f.Add("sha256:" + strings.Repeat("0", 64))
	f.Add("sha256:../../x")
	f.Add("sha256:" + strings.Repeat("a", 64) + "/../../x")
	f.Add("sha512:" + strings.Repeat("a", 128))
	f.Fuzz(func(t *testing.T, s string) {
		d, err := ParseDigest(s)
		if err != nil {
			if errcode.Of(err) != errcode.InvalidInput && errcode.Of(err) != errcode.Internal {
				t.Fatalf("code %s", errcode.Of(err))
			}
			return
		}
		l := &Layout{dir: "/layout"}
		p := l.blobPath(d)
		if filepath.Dir(p) != "/layout/blobs/sha256" || filepath.Base(p) != d.Encoded() || len(d.Encoded()) != 64 ||
			strings.Trim(d.Encoded(), "0123456789abcdef") != "" {
			t.Fatalf("ParseDigest(%q) accepted %q, which maps to %s", s, d, p)
		}
	})
}
