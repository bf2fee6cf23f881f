package ociimage

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/atomicfile"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// openLayout opens ref ("oci:..." with DIR in it) as a *Layout.
func openLayout(t *testing.T, ref string) *Layout {
	t.Helper()
	r, err := ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	repo, err := Open(t.Context(), r)
	if err != nil {
		t.Fatal(err)
	}
	return repo.(*Layout)
}

func blobDesc(mediaType string, data []byte) ocispec.Descriptor {
	return ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(data), Size: int64(len(data))}
}

func putBlob(t *testing.T, repo Repository, mediaType string, data []byte) ocispec.Descriptor {
	t.Helper()
	d := blobDesc(mediaType, data)
	if err := repo.PutBlob(t.Context(), d, data); err != nil {
		t.Fatal(err)
	}
	return d
}

// testManifest stores a config and chunks and returns a manifest over them;
// note makes manifests with the same blobs differ.
func testManifest(t *testing.T, repo Repository, note string, chunks ...string) ocispec.Manifest {
	t.Helper()
	m := ocispec.Manifest{
		ArtifactType: ArtifactTypeDisk,
		Config:       putBlob(t, repo, MediaTypeDiskConfig, []byte(`{"note":"`+note+`"}`)),
		Annotations:  map[string]string{AnnotationDescription: note},
	}
	for _, c := range chunks {
		m.Layers = append(m.Layers, putBlob(t, repo, MediaTypeChunk, []byte(c)))
	}
	return m
}

// strictIndex decodes DIR/index.json refusing anything ocispec.Index does
// not describe, as a strict consumer of the layout would.
func strictIndex(t *testing.T, dir string) ocispec.Index {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "index.json"))
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var idx ocispec.Index
	if err := dec.Decode(&idx); err != nil {
		t.Fatalf("index.json: %v\n%s", err, b)
	}
	if idx.SchemaVersion != 2 || idx.MediaType != ocispec.MediaTypeImageIndex || idx.Manifests == nil {
		t.Fatalf("index.json is not a v2 image index: %s", b)
	}
	return idx
}

func entriesTagged(idx ocispec.Index, tag string) []ocispec.Descriptor {
	var out []ocispec.Descriptor
	for _, e := range idx.Manifests {
		if e.Annotations[AnnotationRefName] == tag {
			out = append(out, e)
		}
	}
	return out
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

func TestLayoutRoundTrip(t *testing.T) {
	ctx := t.Context()
	dir := filepath.Join(t.TempDir(), "snaps", "web") // created by the first write
	repo := openLayout(t, "oci:"+dir+":v1")

	m := testManifest(t, repo, "one", "chunk-0", "chunk-1")
	desc, err := putTagged(ctx, repo, m)
	if err != nil {
		t.Fatal(err)
	}
	if desc.MediaType != ocispec.MediaTypeImageManifest || desc.ArtifactType != ArtifactTypeDisk {
		t.Fatalf("manifest descriptor %+v", desc)
	}
	// Pushing the same manifest again must not add an entry.
	if _, err := putTagged(ctx, repo, m); err != nil {
		t.Fatal(err)
	}

	got, err := os.ReadFile(filepath.Join(dir, "oci-layout"))
	if err != nil || string(got) != `{"imageLayoutVersion":"1.0.0"}` {
		t.Fatalf("oci-layout = %q, %v", got, err)
	}
	idx := strictIndex(t, dir)
	if len(idx.Manifests) != 1 {
		t.Fatalf("index.json has %d entries, want 1: %+v", len(idx.Manifests), idx.Manifests)
	}
	e := idx.Manifests[0]
	if e.Digest != desc.Digest || e.Size != desc.Size || e.ArtifactType != ArtifactTypeDisk || e.Annotations[AnnotationRefName] != "v1" {
		t.Fatalf("index entry %+v, manifest %+v", e, desc)
	}
	if tags, err := repo.Tags(ctx); err != nil || !slices.Equal(tags, []string{"v1"}) {
		t.Fatalf("Tags = %v, %v", tags, err)
	}

	byTag, err := repo.Resolve(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if byTag.Digest != desc.Digest || byTag.Size != desc.Size || byTag.MediaType != desc.MediaType || byTag.Annotations != nil {
		t.Fatalf("Resolve by tag = %+v, want %+v", byTag, desc)
	}
	byDigest, err := openLayout(t, repo.Reference().WithDigest(desc.Digest).String()).Resolve(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if byDigest.Digest != desc.Digest || byDigest.Size != desc.Size {
		t.Fatalf("Resolve by digest = %+v, want %+v", byDigest, desc)
	}

	got2, err := repo.Manifest(ctx, byTag)
	if err != nil {
		t.Fatal(err)
	}
	if got2.SchemaVersion != 2 || got2.MediaType != ocispec.MediaTypeImageManifest || got2.ArtifactType != ArtifactTypeDisk ||
		len(got2.Layers) != 2 || got2.Layers[1].Digest != m.Layers[1].Digest || got2.Annotations[AnnotationDescription] != "one" {
		t.Fatalf("Manifest = %+v", got2)
	}
	data, err := repo.Blob(ctx, got2.Layers[1], MaxChunkSize)
	if err != nil || string(data) != "chunk-1" {
		t.Fatalf("Blob = %q, %v", data, err)
	}

	// Every write went through a temporary file; none may be left.
	_ = filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if strings.HasSuffix(p, ".tmp") || strings.Contains(p, atomicfile.TempInfix) {
			t.Errorf("temporary file left: %s", p)
		}
		return err
	})
	if _, err := os.Stat(filepath.Join(dir, "blobs", "sha256", desc.Digest.Encoded())); err != nil {
		t.Fatalf("manifest blob not at blobs/sha256/HEX: %v", err)
	}
}

func TestReadMissingLayout(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "nothing")
	repo := openLayout(t, "oci:"+dir+":v1")
	_, err := repo.Resolve(t.Context())
	wantCode(t, err, errcode.RegistryError, "no OCI layout at "+dir)
	_, err = repo.Blob(t.Context(), blobDesc(MediaTypeChunk, []byte("x")), 10)
	wantCode(t, err, errcode.RegistryError, "no OCI layout at "+dir)
	if _, err := os.Stat(dir); err == nil {
		t.Fatal("reading created the layout")
	}
	if ok, err := repo.HasBlob(t.Context(), digest.FromString("x")); ok || err != nil {
		t.Fatalf("HasBlob on a missing layout = %v, %v", ok, err)
	}
}

// flipByte changes one byte of the blob d names, in place.
func flipByte(t *testing.T, dir string, d digest.Digest) {
	t.Helper()
	p := filepath.Join(dir, "blobs", "sha256", d.Encoded())
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 0x01
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestFlippedBlobByte(t *testing.T) {
	dir := t.TempDir()
	repo := openLayout(t, "oci:"+dir)
	d := putBlob(t, repo, MediaTypeChunk, []byte("some chunk bytes"))
	flipByte(t, dir, d.Digest)
	_, err := repo.Blob(t.Context(), d, MaxChunkSize)
	wantCode(t, err, errcode.DigestMismatch, "blob "+d.Digest.String()+" in "+dir+" is corrupt: its content does not match its digest")
}

func TestLongerBlobIsCorrupt(t *testing.T) {
	dir := t.TempDir()
	repo := openLayout(t, "oci:"+dir)
	d := putBlob(t, repo, MediaTypeChunk, []byte("chunk"))
	p := filepath.Join(dir, "blobs", "sha256", d.Digest.Encoded())
	if err := os.WriteFile(p, []byte("chunk and more"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := repo.Blob(t.Context(), d, MaxChunkSize)
	wantCode(t, err, errcode.DigestMismatch, "is corrupt")
}

func TestFlippedManifestByte(t *testing.T) {
	dir := t.TempDir()
	repo := openLayout(t, "oci:"+dir+":v1")
	desc, err := putTagged(t.Context(), repo, testManifest(t, repo, "m", "c"))
	if err != nil {
		t.Fatal(err)
	}
	flipByte(t, dir, desc.Digest)
	_, err = repo.Manifest(t.Context(), desc)
	wantCode(t, err, errcode.DigestMismatch, filepath.Join(dir, "blobs", "sha256", desc.Digest.Encoded()))
}

func TestPutManifestMissingLayer(t *testing.T) {
	dir := t.TempDir()
	repo := openLayout(t, "oci:"+dir+":v1")
	m := testManifest(t, repo, "m", "stored")
	missing := blobDesc(MediaTypeChunk, []byte("never stored"))
	m.Layers = append(m.Layers, missing)

	_, err := putTagged(t.Context(), repo, m)
	wantCode(t, err, errcode.RegistryError, missing.Digest.String())
	if idx := strictIndex(t, dir); len(idx.Manifests) != 0 {
		t.Fatalf("a manifest over a missing blob is listed: %+v", idx.Manifests)
	}
	_, _, mdesc, err := encodeManifest(m)
	if err != nil {
		t.Fatal(err)
	}
	if ok, _ := repo.HasBlob(t.Context(), mdesc.Digest); ok {
		t.Fatal("the manifest blob was written")
	}
	_, err = repo.Resolve(t.Context())
	wantCode(t, err, errcode.RegistryError, "no tag v1")
}

func TestPutManifestWrongBlobSize(t *testing.T) {
	repo := openLayout(t, "oci:"+t.TempDir()+":v1")
	m := testManifest(t, repo, "m", "chunk")
	m.Layers[0].Size++
	_, err := putTagged(t.Context(), repo, m)
	wantCode(t, err, errcode.DigestMismatch, "not the 6 the manifest says")
}

func TestRetagMovesTag(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	repo := openLayout(t, "oci:"+dir+":v1")
	d1, err := putTagged(ctx, repo, testManifest(t, repo, "first", "a"))
	if err != nil {
		t.Fatal(err)
	}
	d2, err := putTagged(ctx, repo, testManifest(t, repo, "second", "b"))
	if err != nil {
		t.Fatal(err)
	}

	idx := strictIndex(t, dir)
	if tagged := entriesTagged(idx, "v1"); len(tagged) != 1 || tagged[0].Digest != d2.Digest {
		t.Fatalf("v1 entries after re-tag: %+v", tagged)
	}
	if len(idx.Manifests) != 2 {
		t.Fatalf("the untagged first manifest is no longer listed: %+v", idx.Manifests)
	}
	if r, err := repo.Resolve(ctx); err != nil || r.Digest != d2.Digest {
		t.Fatalf("Resolve v1 = %v, %v; want %s", r.Digest, err, d2.Digest)
	}
	if r, err := openLayout(t, "oci:"+dir+"@"+d1.Digest.String()).Resolve(ctx); err != nil || r.Digest != d1.Digest {
		t.Fatalf("the first manifest is unreachable by digest: %v, %v", r, err)
	}

	// Tagging the untagged first manifest reuses its entry.
	if _, err := putTagged(ctx, openLayout(t, "oci:"+dir+":v0"), testManifest(t, repo, "first", "a")); err != nil {
		t.Fatal(err)
	}
	idx = strictIndex(t, dir)
	if len(idx.Manifests) != 2 || len(entriesTagged(idx, "v0")) != 1 || entriesTagged(idx, "v0")[0].Digest != d1.Digest {
		t.Fatalf("index after tagging v0: %+v", idx.Manifests)
	}
	// Pushing it untagged changes nothing: it is listed already.
	if _, err := putTagged(ctx, openLayout(t, "oci:"+dir), testManifest(t, repo, "first", "a")); err != nil {
		t.Fatal(err)
	}
	if n := len(strictIndex(t, dir).Manifests); n != 2 {
		t.Fatalf("untagged re-push added an entry: %d entries", n)
	}
}

func TestConcurrentPutManifest(t *testing.T) {
	dir := t.TempDir()
	const n = 24
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			ref := fmt.Sprintf("oci:%s:t%d", dir, i)
			if i%4 == 3 {
				ref = "oci:" + dir // some untagged
			}
			r, _ := ParseReference(ref)
			repo, _ := Open(t.Context(), r)
			cfg := []byte(fmt.Sprintf(`{"n":%d}`, i))
			cd := blobDesc(MediaTypeDiskConfig, cfg)
			shared := []byte("a chunk every goroutine stores")
			ld := blobDesc(MediaTypeChunk, shared)
			if err := repo.PutBlob(t.Context(), cd, cfg); err != nil {
				errs <- err
				return
			}
			if err := repo.PutBlob(t.Context(), ld, shared); err != nil {
				errs <- err
				return
			}
			_, err := putTagged(t.Context(), repo, ocispec.Manifest{Config: cd, Layers: []ocispec.Descriptor{ld}})
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	idx := strictIndex(t, dir)
	if len(idx.Manifests) != n {
		t.Fatalf("index.json has %d entries, want %d", len(idx.Manifests), n)
	}
	for i := range n {
		if i%4 != 3 && len(entriesTagged(idx, fmt.Sprintf("t%d", i))) != 1 {
			t.Errorf("tag t%d lost", i)
		}
	}
}

func TestBlobLimitCheckedBeforeRead(t *testing.T) {
	repo := openLayout(t, "oci:"+t.TempDir())
	data := []byte("0123456789abcdef")
	d := putBlob(t, repo, MediaTypeChunk, data)
	_, err := repo.Blob(t.Context(), d, int64(len(data))-1)
	wantCode(t, err, errcode.InvalidInput, "16 bytes")

	// A blob that does not exist is refused for its size, not reported
	// missing: nothing was opened.
	big := ocispec.Descriptor{Digest: digest.FromString("absent"), Size: MaxChunkSize + 1}
	_, err = repo.Blob(t.Context(), big, MaxChunkSize)
	wantCode(t, err, errcode.InvalidInput, "outside")
	big.Size = -1
	_, err = repo.Blob(t.Context(), big, MaxChunkSize)
	wantCode(t, err, errcode.InvalidInput, "outside")

	tooBig := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromString("m"), Size: MaxManifestSize + 1}
	_, err = repo.Manifest(t.Context(), tooBig)
	wantCode(t, err, errcode.InvalidInput, "outside")
}

func TestDigestReferenceToMissingManifest(t *testing.T) {
	dir := t.TempDir()
	repo := openLayout(t, "oci:"+dir+":v1")
	if _, err := putTagged(t.Context(), repo, testManifest(t, repo, "m", "c")); err != nil {
		t.Fatal(err)
	}
	d := digest.FromString("no such manifest")
	_, err := openLayout(t, "oci:"+dir+"@"+d.String()).Resolve(t.Context())
	wantCode(t, err, errcode.RegistryError, "no manifest "+d.String()+" in "+dir)
}

func TestResolveUnknownTagListsTags(t *testing.T) {
	dir := t.TempDir()
	for _, tag := range []string{"b", "a"} {
		repo := openLayout(t, "oci:"+dir+":"+tag)
		if _, err := putTagged(t.Context(), repo, testManifest(t, repo, tag, "c")); err != nil {
			t.Fatal(err)
		}
	}
	_, err := openLayout(t, "oci:"+dir+":c").Resolve(t.Context())
	wantCode(t, err, errcode.RegistryError, "no tag c in "+dir+"; tags present: a, b")

	_, err = openLayout(t, "oci:"+dir).Resolve(t.Context())
	wantCode(t, err, errcode.InvalidInput, "neither a tag nor a digest")
}

func TestResolveDigestNotInIndex(t *testing.T) {
	// A manifest stored as a blob but not listed (written by another tool)
	// still resolves by digest, with its media type read from it.
	repo := openLayout(t, "oci:"+t.TempDir())
	m := testManifest(t, repo, "m", "c")
	_, b, desc, err := encodeManifest(m)
	if err != nil {
		t.Fatal(err)
	}
	putBlob(t, repo, desc.MediaType, b)
	got, err := openLayout(t, "oci:"+repo.dir+"@"+desc.Digest.String()).Resolve(t.Context())
	if err != nil || got.MediaType != desc.MediaType || got.ArtifactType != ArtifactTypeDisk || got.Size != desc.Size {
		t.Fatalf("Resolve = %+v, %v; want %+v", got, err, desc)
	}
}

func TestPutBlobRefusesMismatch(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "l")
	repo := openLayout(t, "oci:"+dir)
	d := blobDesc(MediaTypeChunk, []byte("right"))
	wantCode(t, repo.PutBlob(t.Context(), d, []byte("wrong")), errcode.DigestMismatch, d.Digest.String())
	wantCode(t, repo.PutBlob(t.Context(), d, []byte("right!")), errcode.DigestMismatch, "6 bytes")
	if _, err := os.Stat(dir); err == nil {
		t.Fatal("a refused blob created the layout")
	}
}

func TestManifestRefusesBadManifests(t *testing.T) {
	repo := openLayout(t, "oci:"+t.TempDir())
	base := testManifest(t, repo, "m", "c")
	for name, mut := range map[string]func(m map[string]any){
		"schemaVersion": func(m map[string]any) { m["schemaVersion"] = 1 },
		"mediaType":     func(m map[string]any) { m["mediaType"] = ocispec.MediaTypeImageIndex },
		"layer digest":  func(m map[string]any) { m["layers"].([]any)[0].(map[string]any)["digest"] = "sha256:1234" },
		"layer size":    func(m map[string]any) { m["layers"].([]any)[0].(map[string]any)["size"] = -5 },
		"config digest": func(m map[string]any) { m["config"].(map[string]any)["digest"] = "md5:abc" },
	} {
		_, b, _, err := encodeManifest(base)
		if err != nil {
			t.Fatal(err)
		}
		var raw map[string]any
		if err := json.Unmarshal(b, &raw); err != nil {
			t.Fatal(err)
		}
		mut(raw)
		b, _ = json.Marshal(raw)
		d := putBlob(t, repo, ocispec.MediaTypeImageManifest, b)
		_, err = repo.Manifest(t.Context(), d)
		if errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("%s: Manifest = %v, want INVALID_INPUT", name, err)
		}
	}
}

// putTagged stores m as PutManifest did before tagging became a call of its
// own: by digest, then under the tag of the reference repo was opened from.
func putTagged(ctx context.Context, repo Repository, m ocispec.Manifest) (ocispec.Descriptor, error) {
	desc, err := repo.PutManifest(ctx, m)
	return tagAfter(ctx, repo, desc, err)
}

// pushTagged is PushArtifact, then the tag of repo's reference, if any.
func pushTagged(ctx context.Context, repo Repository, a Artifact) (ocispec.Descriptor, error) {
	desc, err := PushArtifact(ctx, repo, a)
	return tagAfter(ctx, repo, desc, err)
}

func tagAfter(ctx context.Context, repo Repository, desc ocispec.Descriptor, err error) (ocispec.Descriptor, error) {
	if tag := repo.Reference().Tag; err == nil && tag != "" {
		err = TagManifest(ctx, repo, desc, tag)
	}
	return desc, err
}
