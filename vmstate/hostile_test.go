package vmstate

// Hostile records and manifests: arbitrary compatibility records, and
// real layouts whose manifests lie about their layers.

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
)

// FuzzRecord decodes an arbitrary compatibility record the way restore
// does (strictly, as part of the config) and validates and compares it.
func FuzzRecord(f *testing.F) {
	real, _ := json.Marshal(sampleRecord())
	f.Add(real, real)
	other := sampleRecord()
	other.QEMUVersion, other.CPUs, other.Devices = "6.2.0", 4, append(other.Devices, "00:03.0 8086:100e class=0200 id=net0")
	other.DevicesHash = devicesDigest(other.Devices)
	ob, _ := json.Marshal(other)
	f.Add(real, ob)
	withID := sampleRecord()
	withID.VMGenID = "6f1b9c2e-0d4a-4e8b-9f3c-2a7d5e6b8c01"
	wb, _ := json.Marshal(withID)
	f.Add(wb, real)
	f.Add(bytes.Replace(wb, []byte("6f1b"), []byte("../"), 1), wb)
	f.Add([]byte(`{"qemuVersion":"99999999999999999999.1","arch":"x","machine":"m","cpus":1,"memoryBytes":1,"devicesDigest":"`+devicesDigest(nil)+`"}`), real)
	f.Add([]byte(`{"qemuVersion":"7..2","cpus":-1,"memoryBytes":-9223372036854775808,"blocks":[{},{}]}`), real)
	f.Fuzz(func(t *testing.T, a, b []byte) {
		decode := func(data []byte) (Record, bool) {
			dec := json.NewDecoder(bytes.NewReader(data))
			dec.DisallowUnknownFields()
			var r Record
			return r, dec.Decode(&r) == nil
		}
		src, ok := decode(a)
		if !ok {
			return
		}
		if err := src.Validate(); err != nil {
			if errcode.Of(err) != errcode.InvalidInput {
				t.Fatalf("Validate: %v (code %s)", err, errcode.Of(err))
			}
			return
		}
		// A record is compatible with itself, but for the VM generation
		// ID: a copy needs one of its own.
		self := src
		if self.VMGenID != "" {
			self.VMGenID = "00000000-0000-4000-8000-000000000000"
			if self.VMGenID == src.VMGenID {
				self.VMGenID = "00000000-0000-4000-8000-000000000001"
			}
		}
		if d := Compare(src, self); len(d) != 0 {
			t.Fatalf("a record differs from itself: %q", d)
		}
		target, ok := decode(b)
		if !ok {
			return
		}
		err := CheckCompatible(src, target)
		if err != nil && (errcode.Of(err) != errcode.CompatMismatch || len(errcode.DetailsOf(err)) == 0) {
			t.Fatalf("CheckCompatible: %v (code %s)", err, errcode.Of(err))
		}
	})
}

// TestLoadConfigAndDecodeRealLayoutWithHostileLayers pushes a real stream
// into a layout and rewrites its manifest with missing, duplicated and
// oversized layers: LoadConfig or DecodeStream refuse each with a code, and
// nothing is written outside the target directory.
func TestLoadConfigAndDecodeRealLayoutWithHostileLayers(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	dir := filepath.Join(root, "layout")
	data := chunkdata.Stream(t, 200<<10)
	repo := openLayout(t, "oci:"+dir+":vm")
	res, err := chunk.EncodeStream(ctx, bytes.NewReader(data), repo, chunk.StreamOptions{ChunkSize: 64 << 10, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	rec := sampleRecord()
	cfg := Config{Record: rec, Mode: ModePause, RawBytes: res.RawBytes, Compression: "zstd", ChunkSize: 64 << 10}
	push := func(tag string, layers []ocispec.Descriptor, c any) {
		t.Helper()
		// By hand, as another tool could: PushArtifact refuses some of these.
		b, _ := json.Marshal(c)
		cd := ocispec.Descriptor{MediaType: ociimage.MediaTypeVMStateConfig, Digest: digest.FromBytes(b), Size: int64(len(b))}
		r := openLayout(t, "oci:"+dir+":"+tag)
		if err := r.PutBlob(ctx, cd, b); err != nil {
			t.Fatal(err)
		}
		for _, l := range layers {
			if ok, _ := r.HasBlob(ctx, l.Digest); !ok {
				// A stand-in of the right size so that PutManifest stores
				// the manifest; its digest is wrong.
				os.WriteFile(filepath.Join(dir, "blobs", "sha256", l.Digest.Encoded()), bytes.Repeat([]byte("x"), int(l.Size)), 0o644)
			}
		}
		if _, err := putTagged(ctx, r, ocispec.Manifest{ArtifactType: ociimage.ArtifactTypeVMState, Config: cd, Layers: layers}); err != nil {
			t.Fatalf("%s: %v", tag, err)
		}
	}
	withRaw := func(l ocispec.Descriptor, raw string) ocispec.Descriptor {
		l.Annotations = map[string]string{ociimage.AnnotationRawSize: raw}
		return l
	}
	L := res.Layers
	raw0, _ := strconv.Atoi(L[0].Annotations[ociimage.AnnotationRawSize]) // the first chunk's size (content-defined)
	r0 := strconv.Itoa(raw0)
	missing := withRaw(ocispec.Descriptor{MediaType: ociimage.MediaTypeChunk, Digest: digest.FromString("missing"), Size: 10}, "10")
	cases := []struct {
		tag    string
		layers []ocispec.Descriptor
		cfg    func(c *Config)
		code   errcode.Code
		stage  string // "load" or "decode"
		remove bool   // remove the stand-in blob after the push: a missing chunk
	}{
		{"real", L, nil, "", "", false},
		{"no-layers", []ocispec.Descriptor{}, func(c *Config) { c.RawBytes = 0 }, errcode.InvalidInput, "load", false},
		{"duplicate-with-offsets", append(append([]ocispec.Descriptor{}, L...), L[0]), nil, errcode.InvalidInput, "load", false},
		{"dropped-layer", L[1:], nil, errcode.InvalidInput, "load", false},
		{"rawbytes-lies", L, func(c *Config) { c.RawBytes++ }, errcode.InvalidInput, "load", false},
		{"bad-record", L, func(c *Config) { c.Record.DevicesHash = "sha256:00" }, errcode.InvalidInput, "load", false},
		{"no-cpus", L, func(c *Config) { c.Record.CPUs = 0 }, errcode.InvalidInput, "load", false},
		{"corrupt-blob", []ocispec.Descriptor{withRaw(L[0], r0), missing}, func(c *Config) { c.RawBytes = int64(raw0) + 10 }, errcode.DigestMismatch, "decode", false},
		{"missing-blob", []ocispec.Descriptor{withRaw(L[0], r0), missing}, func(c *Config) { c.RawBytes = int64(raw0) + 10 }, errcode.RegistryError, "decode", true},
		{"raw-size-lies", []ocispec.Descriptor{withRaw(L[0], strconv.Itoa(raw0+1))}, func(c *Config) { c.RawBytes = int64(raw0) + 1 }, errcode.InvalidInput, "decode", false},
	}
	for _, tc := range cases {
		t.Run(tc.tag, func(t *testing.T) {
			c := cfg
			if tc.cfg != nil {
				tc.cfg(&c)
			}
			push(tc.tag, tc.layers, c)
			if tc.remove {
				os.Remove(filepath.Join(dir, "blobs", "sha256", missing.Digest.Encoded()))
			}
			before := dirList(t, root)
			r := openLayout(t, "oci:"+dir+":"+tc.tag)
			_, m, _, err := LoadConfig(ctx, r)
			if tc.stage == "load" {
				if errcode.Of(err) != tc.code {
					t.Fatalf("LoadConfig = %v (code %s), want %s", err, errcode.Of(err), tc.code)
				}
				return
			}
			if err != nil {
				t.Fatalf("LoadConfig: %v", err)
			}
			out := &chunkdata.CapWriter{Max: len(data) + 1}
			_, err = chunk.DecodeStream(ctx, m.Layers, r, out, chunk.StreamOptions{Workers: 2})
			if errcode.Of(err) != tc.code {
				t.Fatalf("chunk.DecodeStream = %v (code %s), want %s", err, errcode.Of(err), tc.code)
			}
			if tc.code == "" && !bytes.Equal(out.Buf.Bytes(), data) {
				t.Fatal("round trip differs")
			}
			if after := dirList(t, root); after != before {
				t.Fatalf("reading changed the tree:\n%s\n->\n%s", before, after)
			}
		})
	}
}

func dirList(t *testing.T, root string) string {
	var b strings.Builder
	filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
		if err == nil {
			if fi.IsDir() {
				b.WriteString(p + "/\n")
			} else {
				b.WriteString(p + " " + strconv.FormatInt(fi.Size(), 10) + " " + fi.ModTime().String() + "\n")
			}
		}
		return nil
	})
	return b.String()
}

// putTagged stores m by digest, then under the tag of repo's reference.
func putTagged(ctx context.Context, repo ociimage.Repository, m ocispec.Manifest) (ocispec.Descriptor, error) {
	desc, err := repo.PutManifest(ctx, m)
	if tag := repo.Reference().Tag; err == nil && tag != "" {
		err = ociimage.TagManifest(ctx, repo, desc, tag)
	}
	return desc, err
}
