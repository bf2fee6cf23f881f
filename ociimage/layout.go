package ociimage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/atomicfile"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/internal/unhashed"
)

// lockName is the file whose flock serialises updates of index.json. The
// index itself cannot be locked: it is replaced by rename, so a lock on it
// would be on the old file.
const lockName = "index.json.lock"

// Layout is a Repository in an OCI image layout directory:
//
//	DIR/oci-layout              {"imageLayoutVersion":"1.0.0"}
//	DIR/index.json              an image index listing every manifest
//	DIR/blobs/sha256/HEX        manifests, configs and chunks
//	DIR/index.json.lock         flocked while index.json is updated
//
// Every file is written to a temporary file, synced and renamed into place,
// so a reader sees a file whole or not at all. Several processes may write
// the same layout at once.
type Layout struct {
	ref Reference
	dir string
	// root, if set, is a handle of dir: the layout is read beneath it
	// only, and never written (OpenLayoutIn).
	root *os.File
}

var _ Repository = (*Layout)(nil)

// Reference is what the layout was opened from.
func (l *Layout) Reference() Reference { return l.ref }

func (l *Layout) blobDir() string {
	return filepath.Join(l.dir, ocispec.ImageBlobsDir, digest.SHA256.String())
}

func (l *Layout) blobPath(d digest.Digest) string { return filepath.Join(l.blobDir(), d.Encoded()) }

// HasBlob reports whether the layout holds the blob. A missing layout holds
// nothing.
func (l *Layout) HasBlob(ctx context.Context, d digest.Digest) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	if _, err := ParseDigest(string(d)); err != nil {
		return false, errcode.Wrap(errcode.InvalidInput, err, "invalid blob digest %q", d)
	}
	_, err := l.stat(blobRel(d))
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, fs.ErrNotExist):
		return false, nil
	}
	return false, errcode.Wrap(errcode.RegistryError, err, "cannot check for blob %s in %s", d, l.dir)
}

// PutBlob stores data as the blob desc names, after checking the data
// matches it. A blob already present with the right size is left alone.
func (l *Layout) PutBlob(ctx context.Context, desc ocispec.Descriptor, data []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := verifyData(desc, data); err != nil {
		return err
	}
	if err := l.ensureLayout(ctx); err != nil {
		return err
	}
	return l.putBlob(desc.Digest, data)
}

// verifyData refuses data that is not what desc describes, before anything
// is written: a blob must never be stored under another's digest.
func verifyData(desc ocispec.Descriptor, data []byte) error {
	if _, err := ParseDigest(string(desc.Digest)); err != nil {
		return errcode.Wrap(errcode.InvalidInput, err, "invalid blob digest %q", desc.Digest)
	}
	if int64(len(data)) != desc.Size {
		return errcode.New(errcode.DigestMismatch, "data for blob %s is %d bytes, not the %d its descriptor says", desc.Digest, len(data), desc.Size)
	}
	if got := digest.FromBytes(data); got != desc.Digest {
		return errcode.New(errcode.DigestMismatch, "data for blob %s has digest %s; the descriptor does not describe this data", desc.Digest, got)
	}
	return nil
}

func (l *Layout) putBlob(d digest.Digest, data []byte) error {
	// Blobs are named by their content, so one already here with the right
	// size is this data; a size that differs is a torn write by some other
	// tool, and is replaced.
	if fi, err := os.Stat(l.blobPath(d)); err == nil && fi.Mode().IsRegular() && fi.Size() == int64(len(data)) {
		return nil
	}
	if err := writeAtomic(l.blobDir(), d.Encoded(), data); err != nil {
		return errcode.Wrap(errcode.RegistryError, err, "cannot write blob %s to %s; check that the directory is writable and the disk has space", d, l.dir)
	}
	return nil
}

// ensureLayout creates the layout's directories, oci-layout and index.json
// if they are missing.
func (l *Layout) ensureLayout(ctx context.Context) error {
	if err := l.readOnly(); err != nil {
		return err
	}
	layoutFile := filepath.Join(l.dir, ocispec.ImageLayoutFile)
	indexFile := filepath.Join(l.dir, ocispec.ImageIndexFile)
	if exists(layoutFile) && exists(indexFile) && exists(l.blobDir()) {
		return nil
	}
	if err := os.MkdirAll(l.blobDir(), 0o755); err != nil {
		return errcode.Wrap(errcode.RegistryError, err, "cannot create OCI layout %s; check that its parent is writable", l.dir)
	}
	// Under the lock, so that creating an empty index cannot overwrite one
	// another process has just written.
	unlock, err := l.lock(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	if !exists(layoutFile) {
		b, _ := json.Marshal(ocispec.ImageLayout{Version: ocispec.ImageLayoutVersion})
		if err := writeAtomic(l.dir, ocispec.ImageLayoutFile, b); err != nil {
			return errcode.Wrap(errcode.RegistryError, err, "cannot create OCI layout %s", l.dir)
		}
	}
	if !exists(indexFile) {
		if err := l.writeIndex(newIndex()); err != nil {
			return err
		}
	}
	return nil
}

func (l *Layout) lock(ctx context.Context) (unlock func(), err error) {
	if err := l.readOnly(); err != nil {
		return nil, err
	}
	unlock, err = lockFile(ctx, filepath.Join(l.dir, lockName))
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, errcode.Wrap(errcode.RegistryError, err, "cannot lock %s for update", l.dir)
	}
	return unlock, nil
}

// PutManifest stores m and lists it, untagged, in index.json (a manifest
// listed already keeps its entry and tags). It refuses a manifest whose blobs are not
// all stored: a manifest is never stored over missing blobs.
func (l *Layout) PutManifest(ctx context.Context, m ocispec.Manifest) (ocispec.Descriptor, error) {
	return l.putManifest(ctx, m, nil)
}

// PutPartialManifest is PutManifest of a manifest whose layers that
// omitted accepts are deliberately not stored (CopyLayers: a staged
// memory-file image's RAM regions, prepared apart). Every other blob
// must be. Only for a layout that a reader of those layers never opens.
func (l *Layout) PutPartialManifest(ctx context.Context, m ocispec.Manifest, omitted func(ocispec.Descriptor) bool) (ocispec.Descriptor, error) {
	return l.putManifest(ctx, m, omitted)
}

func (l *Layout) putManifest(ctx context.Context, m ocispec.Manifest, omitted func(ocispec.Descriptor) bool) (ocispec.Descriptor, error) {
	if err := ctx.Err(); err != nil {
		return ocispec.Descriptor{}, err
	}
	m, b, desc, err := encodeManifest(m)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	if l.ref.IsDigest() {
		return ocispec.Descriptor{}, errcode.New(errcode.InvalidInput,
			"cannot store a manifest at %s: a digest reference names an existing manifest; push to oci:%s or oci:%s:TAG", l.ref, l.dir, l.dir)
	}
	if err := l.checkBlobs(m, omitted); err != nil {
		return ocispec.Descriptor{}, err
	}
	if err := l.ensureLayout(ctx); err != nil {
		return ocispec.Descriptor{}, err
	}
	// Blobs are checked and the manifest written under the lock, which
	// CollectGarbage holds while it sweeps: a blob it removed is refused
	// here, and a manifest is never listed over a removed blob.
	unlock, err := l.lock(ctx)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	defer unlock()
	if err := l.checkBlobs(m, omitted); err != nil {
		return ocispec.Descriptor{}, err
	}
	if err := l.putBlob(desc.Digest, b); err != nil {
		return ocispec.Descriptor{}, err
	}
	idx, err := l.readIndex()
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	addToIndex(&idx, desc, "")
	if err := l.writeIndex(idx); err != nil {
		return ocispec.Descriptor{}, err
	}
	return desc, nil
}

// checkBlobs refuses a manifest whose config or layers are not all stored
// whole.
func (l *Layout) checkBlobs(m ocispec.Manifest, omitted func(ocispec.Descriptor) bool) error {
	for i, bd := range append([]ocispec.Descriptor{m.Config}, m.Layers...) {
		if i > 0 && omitted != nil && omitted(bd) {
			continue
		}
		what := "config"
		if i > 0 {
			what = fmt.Sprintf("layer %d", i-1)
		}
		fi, err := os.Stat(l.blobPath(bd.Digest))
		if errors.Is(err, fs.ErrNotExist) {
			return errcode.New(errcode.RegistryError,
				"refusing to store the manifest: its %s blob %s is not in %s; store every blob before the manifest", what, bd.Digest, l.dir)
		}
		if err != nil {
			return errcode.Wrap(errcode.RegistryError, err, "cannot check the %s blob %s in %s", what, bd.Digest, l.dir)
		}
		if fi.Size() != bd.Size {
			return errcode.New(errcode.DigestMismatch,
				"refusing to store the manifest: its %s blob %s in %s is %d bytes, not the %d the manifest says; store it again", what, bd.Digest, l.dir, fi.Size(), bd.Size)
		}
	}
	return nil
}

// Resolve returns the descriptor of the manifest the reference names.
func (l *Layout) Resolve(ctx context.Context) (ocispec.Descriptor, error) {
	return l.resolveRef(ctx, l.ref)
}

// ResolveTag is Repository.ResolveTag.
func (l *Layout) ResolveTag(ctx context.Context, tag string) (ocispec.Descriptor, error) {
	return l.resolveRef(ctx, l.ref.WithTag(tag))
}

// resolveRef is Resolve for ref, a reference into this repository.
func (l *Layout) resolveRef(ctx context.Context, ref Reference) (ocispec.Descriptor, error) {
	if err := ctx.Err(); err != nil {
		return ocispec.Descriptor{}, err
	}
	if !ref.IsDigest() && ref.Tag == "" {
		return ocispec.Descriptor{}, errcode.New(errcode.InvalidInput,
			"%s names neither a tag nor a digest; use %s:TAG or %s@sha256:HEX", ref, ref, ref)
	}
	idx, err := l.index()
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	if ref.IsDigest() {
		return l.resolveDigest(idx, ref.Digest)
	}

	var found []ocispec.Descriptor
	for _, e := range idx.Manifests {
		if e.Annotations[AnnotationRefName] == ref.Tag && !slices.ContainsFunc(found, func(f ocispec.Descriptor) bool { return f.Digest == e.Digest }) {
			found = append(found, e)
		}
	}
	switch len(found) {
	case 0:
		tags := indexTags(idx)
		present := "the layout has no tags"
		if len(tags) > 0 {
			present = "tags present: " + strings.Join(tags, ", ")
		}
		return ocispec.Descriptor{}, notFound{errcode.New(errcode.RegistryError, "no tag %s in %s; %s", ref.Tag, l.dir, present)}
	case 1:
		return withoutRefName(found[0]), nil
	}
	// Only another tool can have written this; guessing could restore the
	// wrong snapshot.
	return ocispec.Descriptor{}, errcode.New(errcode.RegistryError,
		"tag %s names %d different manifests in %s/index.json; use a digest reference, %s@sha256:HEX", ref.Tag, len(found), l.dir, ref.WithDigest("").String())
}

func (l *Layout) resolveDigest(idx ocispec.Index, d digest.Digest) (ocispec.Descriptor, error) {
	fi, err := l.stat(blobRel(d))
	if errors.Is(err, fs.ErrNotExist) {
		return ocispec.Descriptor{}, notFound{errcode.New(errcode.RegistryError, "no manifest %s in %s; check the digest, or use a tag", d, l.dir)}
	}
	if err != nil {
		return ocispec.Descriptor{}, errcode.Wrap(errcode.RegistryError, err, "cannot read manifest %s in %s", d, l.dir)
	}
	for _, e := range idx.Manifests {
		if e.Digest == d {
			return withoutRefName(e), nil
		}
	}
	// Not listed (another tool wrote it, or the index lost it): take the
	// media type from the manifest itself. Manifest verifies the rest.
	if fi.Size() > MaxManifestSize {
		return ocispec.Descriptor{}, errcode.New(errcode.InvalidInput, "%s in %s is %d bytes, too large to be a manifest; check the digest", d, l.dir, fi.Size())
	}
	b, err := l.readFile(blobRel(d), MaxManifestSize)
	if err != nil {
		return ocispec.Descriptor{}, errcode.Wrap(errcode.RegistryError, err, "cannot read manifest %s in %s", d, l.dir)
	}
	var head struct {
		MediaType    string `json:"mediaType"`
		ArtifactType string `json:"artifactType"`
	}
	if json.Unmarshal(b, &head) != nil || head.MediaType == "" {
		return ocispec.Descriptor{}, errcode.New(errcode.InvalidInput, "%s in %s is not a manifest; check the digest", d, l.dir)
	}
	return ocispec.Descriptor{MediaType: head.MediaType, Digest: d, Size: int64(len(b)), ArtifactType: head.ArtifactType}, nil
}

// withoutRefName returns an index entry as a manifest descriptor: the tag
// annotation belongs to the index, not to the manifest.
func withoutRefName(e ocispec.Descriptor) ocispec.Descriptor {
	if _, ok := e.Annotations[AnnotationRefName]; ok {
		a := make(map[string]string, len(e.Annotations))
		for k, v := range e.Annotations {
			if k != AnnotationRefName {
				a[k] = v
			}
		}
		e.Annotations = a
		if len(a) == 0 {
			e.Annotations = nil
		}
	}
	return e
}

// Manifest reads, verifies and parses the manifest desc names.
func (l *Layout) Manifest(ctx context.Context, desc ocispec.Descriptor) (ocispec.Manifest, error) {
	if desc.MediaType != "" && desc.MediaType != ocispec.MediaTypeImageManifest {
		return ocispec.Manifest{}, errcode.New(errcode.InvalidInput,
			"%s in %s is a %s, not an image manifest; vmsnap reads only the image manifests it writes", desc.Digest, l.dir, desc.MediaType)
	}
	b, err := l.readBlob(ctx, "manifest", desc, MaxManifestSize)
	if err != nil {
		return ocispec.Manifest{}, err
	}
	m, err := decodeManifest(b)
	if err != nil {
		return ocispec.Manifest{}, errcode.Wrap(errcode.InvalidInput, err, "%s in %s", desc.Digest, l.dir)
	}
	return m, nil
}

// Blob reads the whole blob desc names, refusing one larger than limit before
// reading it, and verifies its size and digest.
func (l *Layout) Blob(ctx context.Context, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	return l.readBlob(ctx, "blob", desc, limit)
}

// BlobUnhashed is Blob checking the size alone, for a reader beneath
// ociimage that verifies the bytes itself (imgcrypt's Decrypt, see
// package unhashed).
func (l *Layout) BlobUnhashed(ctx context.Context, _ unhashed.Key, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	return l.readChecked(ctx, "blob", desc, limit, false)
}

func (l *Layout) readBlob(ctx context.Context, what string, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	return l.readChecked(ctx, what, desc, limit, true)
}

func (l *Layout) readChecked(ctx context.Context, what string, desc ocispec.Descriptor, limit int64, hashed bool) ([]byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := checkFetch(what, desc, limit); err != nil {
		return nil, err
	}
	path := l.blobPath(desc.Digest)
	f, _, err := l.openFile(blobRel(desc.Digest))
	if errors.Is(err, fs.ErrNotExist) {
		if err := l.checkLayout(); err != nil {
			return nil, err
		}
		return nil, errcode.New(errcode.RegistryError, "%s %s is missing from %s; the image is incomplete, push it again", what, desc.Digest, l.dir)
	}
	if err != nil {
		return nil, errcode.Wrap(errcode.RegistryError, err, "cannot read %s %s in %s", what, desc.Digest, l.dir)
	}
	defer f.Close()

	// One byte more than expected tells a longer file from a right one
	// without reading all of it.
	buf := make([]byte, desc.Size+1)
	n, err := io.ReadFull(f, buf)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return nil, errcode.Wrap(errcode.RegistryError, err, "cannot read %s %s in %s", what, desc.Digest, l.dir)
	}
	if int64(n) != desc.Size || hashed && digest.FromBytes(buf[:n]) != desc.Digest {
		return nil, errcode.New(errcode.DigestMismatch,
			"%s %s in %s is corrupt: its content does not match its digest (file %s); push the image again", what, desc.Digest, l.dir, path)
	}
	return buf[:n], nil
}

// index checks the layout and reads its index.json. Readers take no lock:
// a writer replaces the index by rename, so it is read whole, before or
// after.
func (l *Layout) index() (ocispec.Index, error) {
	if err := l.checkLayout(); err != nil {
		return ocispec.Index{}, err
	}
	return l.readIndex()
}

// lockedIndex takes the layout's lock and reads index.json under it, for a
// writer; the caller releases the lock with unlock.
func (l *Layout) lockedIndex(ctx context.Context) (idx ocispec.Index, unlock func(), err error) {
	if unlock, err = l.lock(ctx); err != nil {
		return ocispec.Index{}, nil, err
	}
	if idx, err = l.readIndex(); err != nil {
		unlock()
		return ocispec.Index{}, nil, err
	}
	return idx, unlock, nil
}

// Tags lists the tags in the layout's index.json, sorted.
func (l *Layout) Tags(ctx context.Context) ([]string, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	idx, err := l.index()
	if err != nil {
		return nil, err
	}
	return indexTags(idx), nil
}

func indexTags(idx ocispec.Index) []string {
	var tags []string
	for _, e := range idx.Manifests {
		if t := e.Annotations[AnnotationRefName]; t != "" {
			tags = append(tags, t)
		}
	}
	slices.Sort(tags)
	return slices.Compact(tags)
}

// checkLayout tells a missing or foreign directory from a missing file in
// a layout, so that errors name the real problem.
func (l *Layout) checkLayout() error {
	b, err := l.readFile(ocispec.ImageLayoutFile, maxLayoutFile)
	if errors.Is(err, fs.ErrNotExist) {
		return notFound{errcode.New(errcode.RegistryError, "no OCI layout at %s; check the path, or push an image there first", l.dir)}
	}
	if err != nil {
		return errcode.Wrap(errcode.RegistryError, err, "cannot read OCI layout %s", l.dir)
	}
	var v ocispec.ImageLayout
	if err := json.Unmarshal(b, &v); err != nil || v.Version != ocispec.ImageLayoutVersion {
		return errcode.New(errcode.InvalidInput, "%s/%s is not an OCI layout version %s file; vmsnap reads only that version",
			l.dir, ocispec.ImageLayoutFile, ocispec.ImageLayoutVersion)
	}
	return nil
}

// readIndex reads index.json; a missing one is an empty index (the layout
// is being created).
func (l *Layout) readIndex() (ocispec.Index, error) {
	path := l.name(ocispec.ImageIndexFile)
	f, _, err := l.openFile(ocispec.ImageIndexFile)
	if errors.Is(err, fs.ErrNotExist) {
		return newIndex(), nil
	}
	if err != nil {
		return ocispec.Index{}, errcode.Wrap(errcode.RegistryError, err, "cannot read %s", path)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, MaxIndexSize+1))
	if err != nil {
		return ocispec.Index{}, errcode.Wrap(errcode.RegistryError, err, "cannot read %s", path)
	}
	if len(b) > MaxIndexSize {
		return ocispec.Index{}, errcode.New(errcode.InvalidInput, "%s is larger than %d bytes; split the layout into several directories", path, MaxIndexSize)
	}
	var idx ocispec.Index
	if err := json.Unmarshal(b, &idx); err != nil {
		return ocispec.Index{}, errcode.Wrap(errcode.InvalidInput, err, "%s is not valid JSON; repair it, or remove it and push the images again", path)
	}
	if idx.SchemaVersion != 2 {
		return ocispec.Index{}, errcode.New(errcode.InvalidInput, "%s has schemaVersion %d, not 2", path, idx.SchemaVersion)
	}
	for i, e := range idx.Manifests {
		if _, err := ParseDigest(string(e.Digest)); err != nil || e.Size < 0 {
			return ocispec.Index{}, errcode.New(errcode.InvalidInput, "%s: entry %d has an invalid digest %q or size %d; repair the file", path, i, e.Digest, e.Size)
		}
	}
	if idx.Manifests == nil {
		idx.Manifests = []ocispec.Descriptor{}
	}
	return idx, nil
}

// writeIndex replaces index.json. The caller holds the lock.
func (l *Layout) writeIndex(idx ocispec.Index) error {
	idx.SchemaVersion = 2
	idx.MediaType = ocispec.MediaTypeImageIndex
	b, err := json.Marshal(idx)
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "cannot encode index.json")
	}
	if err := writeAtomic(l.dir, ocispec.ImageIndexFile, b); err != nil {
		return errcode.Wrap(errcode.RegistryError, err, "cannot write %s/%s; check that the directory is writable and the disk has space", l.dir, ocispec.ImageIndexFile)
	}
	return nil
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// writeAtomic replaces dir/name with data so that readers, and the file
// after a crash, hold either the old content or all of the new. The mode is
// 0644: layouts are read by other users and tools (skopeo, registries'
// import jobs).
func writeAtomic(dir, name string, data []byte) error {
	return atomicfile.WriteFile(filepath.Join(dir, name), data, 0o644)
}
