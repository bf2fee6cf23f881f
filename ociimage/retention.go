package ociimage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"

	"github.com/vmsnap/vmsnap/internal/atomicfile"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// What retention (vmsnap prune) needs of a store beyond Repository, as small
// interfaces that Layout and Registry implement.

// TagLister lists a repository's tags with the manifest each names.
type TagLister interface {
	// ListTags returns every tag (at most MaxTags), sorted, each with the
	// descriptor of what it names (an image manifest, or an index such as
	// a referrers fallback tag's).
	ListTags(ctx context.Context) ([]TaggedManifest, error)
}

// TaggedManifest is one tag and what it names.
type TaggedManifest struct {
	Tag        string
	Descriptor ocispec.Descriptor
}

// DigestResolver describes a manifest of the repository by its digest,
// whatever reference the repository was opened with. A manifest the store
// does not hold is an error that errors.Is(err, ErrNotFound).
type DigestResolver interface {
	ResolveDigest(ctx context.Context, d digest.Digest) (ocispec.Descriptor, error)
}

// ManifestDeleter deletes a manifest by digest, and with it every tag that
// names it. A manifest already gone is not an error, so that an interrupted
// deletion can simply be run again.
type ManifestDeleter interface {
	DeleteManifest(ctx context.Context, d digest.Digest) error
}

// GarbageCollector removes the blobs no manifest of the repository needs.
// Registries collect their own garbage (distribution: registry
// garbage-collect); a layout does it here.
type GarbageCollector interface {
	// CollectGarbage removes every blob that is not reachable from the
	// manifests index.json lists or from roots (through configs, layers,
	// subjects and index entries) and was last written before `before`,
	// so that blobs a writer has stored but not yet named in a manifest
	// survive. It returns the digests removed.
	CollectGarbage(ctx context.Context, before time.Time, roots []digest.Digest) ([]digest.Digest, error)
}

var (
	_ TagLister        = (*Layout)(nil)
	_ TagLister        = (*Registry)(nil)
	_ DigestResolver   = (*Layout)(nil)
	_ DigestResolver   = (*Registry)(nil)
	_ ManifestDeleter  = (*Layout)(nil)
	_ ManifestDeleter  = (*Registry)(nil)
	_ GarbageCollector = (*Layout)(nil)
)

// ErrNotFound is in the chain of an error about a tag or manifest the store
// does not hold (errors.Is), whatever its code and message.
var ErrNotFound = errors.New("not found")

// notFound marks err as ErrNotFound without changing its text or code.
type notFound struct{ err error }

func (n notFound) Error() string        { return n.err.Error() }
func (n notFound) Unwrap() error        { return n.err }
func (n notFound) Is(target error) bool { return target == ErrNotFound }

// ErrDeletesDisabled is in the chain of the error of a registry that
// refuses deletes (405 UNSUPPORTED): distribution does unless its config
// enables storage.delete.
var ErrDeletesDisabled = errors.New("the registry answered 405 Method Not Allowed (UNSUPPORTED) to a manifest DELETE")

// --- layout ---

// ListTags lists the layout's tags from index.json. A tag listed twice (only
// another tool writes that) is refused: which one it names is not known.
func (l *Layout) ListTags(ctx context.Context) ([]TaggedManifest, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	idx, err := l.index()
	if err != nil {
		return nil, err
	}
	var out []TaggedManifest
	for _, e := range idx.Manifests {
		tag := e.Annotations[AnnotationRefName]
		if tag == "" {
			continue
		}
		if slices.ContainsFunc(out, func(t TaggedManifest) bool { return t.Tag == tag }) {
			return nil, errcode.New(errcode.InvalidInput, "tag %s is listed more than once in %s/index.json; repair the file", tag, l.dir)
		}
		out = append(out, TaggedManifest{Tag: tag, Descriptor: withoutRefName(e)})
	}
	slices.SortFunc(out, func(a, b TaggedManifest) int { return strings.Compare(a.Tag, b.Tag) })
	return out, nil
}

// ResolveDigest describes the manifest d names in the layout.
func (l *Layout) ResolveDigest(ctx context.Context, d digest.Digest) (ocispec.Descriptor, error) {
	if err := ctx.Err(); err != nil {
		return ocispec.Descriptor{}, err
	}
	if _, err := ParseDigest(string(d)); err != nil {
		return ocispec.Descriptor{}, errcode.Wrap(errcode.InvalidInput, err, "invalid manifest digest %q", d)
	}
	idx, err := l.index()
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	return l.resolveDigest(idx, d)
}

// DeleteManifest drops every index.json entry of d (and so its tags), in
// one atomic rewrite of the index under the layout's lock. The manifest's
// blob and those it names stay until CollectGarbage: a crash in between
// leaves unreferenced blobs, never a listed manifest with missing ones.
func (l *Layout) DeleteManifest(ctx context.Context, d digest.Digest) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if _, err := ParseDigest(string(d)); err != nil {
		return errcode.Wrap(errcode.InvalidInput, err, "invalid manifest digest %q", d)
	}
	if err := l.checkLayout(); err != nil {
		return err
	}
	idx, unlock, err := l.lockedIndex(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	n := len(idx.Manifests)
	idx.Manifests = slices.DeleteFunc(idx.Manifests, func(e ocispec.Descriptor) bool { return e.Digest == d })
	if len(idx.Manifests) == n {
		return nil
	}
	return l.writeIndex(idx)
}

// CollectGarbage removes the blobs of the layout that nothing listed needs.
// It holds the index lock throughout, so no manifest can be listed while it
// sweeps; PutManifest checks its blobs under the same lock, so a writer
// whose blob was swept gets a clean refusal, never a listed manifest with a
// missing blob. A manifest it cannot read or parse stops it before anything
// is removed: what that manifest needs is not known.
func (l *Layout) CollectGarbage(ctx context.Context, before time.Time, roots []digest.Digest) ([]digest.Digest, error) {
	if err := l.checkLayout(); err != nil {
		return nil, err
	}
	idx, unlock, err := l.lockedIndex(ctx)
	if err != nil {
		return nil, err
	}
	defer unlock()
	live := map[digest.Digest]bool{}
	var manifests []digest.Digest // to read: they name more
	for _, e := range idx.Manifests {
		manifests = append(manifests, e.Digest)
	}
	manifests = append(manifests, roots...)
	for len(manifests) > 0 {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		d := manifests[len(manifests)-1]
		manifests = manifests[:len(manifests)-1]
		if live[d] {
			continue
		}
		live[d] = true
		blobs, more, err := l.namedBy(d)
		if err != nil {
			return nil, err
		}
		for _, b := range blobs {
			live[b] = true
		}
		manifests = append(manifests, more...)
	}
	return l.sweep(ctx, live, before)
}

// namedBy returns what the manifest or index stored as blob d names: blobs
// (config and layers, not read) and manifests (subject, index entries, to
// read in turn). A missing blob names nothing (its manifest is incomplete
// already), nor does one that is not a manifest.
func (l *Layout) namedBy(d digest.Digest) (blobs, manifests []digest.Digest, err error) {
	if _, err := ParseDigest(string(d)); err != nil {
		return nil, nil, errcode.New(errcode.InvalidInput, "%s names an invalid digest %q; repair it before collecting garbage", l.dir, d)
	}
	path := l.blobPath(d)
	fi, err := l.stat(blobRel(d))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, errcode.Wrap(errcode.RegistryError, err, "cannot read %s", path)
	}
	if fi.Size() > MaxManifestSize || !fi.Mode().IsRegular() {
		return nil, nil, nil // too large to be a manifest
	}
	b, err := l.readFile(blobRel(d), MaxManifestSize)
	if err != nil {
		return nil, nil, errcode.Wrap(errcode.RegistryError, err, "cannot read %s", path)
	}
	var m struct {
		MediaType string               `json:"mediaType"`
		Config    *ocispec.Descriptor  `json:"config"`
		Layers    []ocispec.Descriptor `json:"layers"`
		Manifests []ocispec.Descriptor `json:"manifests"`
		Subject   *ocispec.Descriptor  `json:"subject"`
	}
	if json.Unmarshal(b, &m) != nil {
		return nil, nil, nil // not a manifest
	}
	check := func(c ocispec.Descriptor) error {
		if _, err := ParseDigest(string(c.Digest)); err != nil {
			return errcode.New(errcode.InvalidInput,
				"manifest %s in %s names an invalid digest %q; nothing was removed: repair or remove that manifest first", d, l.dir, c.Digest)
		}
		return nil
	}
	for _, c := range append(m.Layers, deref(m.Config)) {
		if c.Digest == "" && c.Size == 0 {
			continue
		}
		if err := check(c); err != nil {
			return nil, nil, err
		}
		blobs = append(blobs, c.Digest)
	}
	for _, c := range append(m.Manifests, deref(m.Subject)) {
		if c.Digest == "" && c.Size == 0 {
			continue
		}
		if err := check(c); err != nil {
			return nil, nil, err
		}
		manifests = append(manifests, c.Digest)
	}
	return blobs, manifests, nil
}

func deref(d *ocispec.Descriptor) ocispec.Descriptor {
	if d == nil {
		return ocispec.Descriptor{}
	}
	return *d
}

// sweep removes the blobs not in live and last written before `before`.
// Files that are not blobs (temporary files of an interrupted write, other
// tools' files) are left alone.
func (l *Layout) sweep(ctx context.Context, live map[digest.Digest]bool, before time.Time) ([]digest.Digest, error) {
	dir, err := os.Open(l.blobDir())
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, errcode.Wrap(errcode.RegistryError, err, "cannot list the blobs of %s", l.dir)
	}
	defer dir.Close()
	var removed []digest.Digest
	for {
		// In batches: a layout may hold very many chunks.
		entries, err := dir.ReadDir(1024)
		for _, e := range entries {
			if cerr := ctx.Err(); cerr != nil {
				return removed, cerr
			}
			d := digest.NewDigestFromEncoded(digest.SHA256, e.Name())
			if d.Validate() != nil || !e.Type().IsRegular() || live[d] {
				continue
			}
			fi, ierr := e.Info()
			if ierr != nil || !fi.ModTime().Before(before) {
				continue
			}
			if rerr := os.Remove(l.blobPath(d)); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
				return removed, errcode.Wrap(errcode.RegistryError, rerr, "cannot remove blob %s from %s", d, l.dir)
			}
			removed = append(removed, d)
		}
		if err != nil {
			break // io.EOF, or an error that a partial sweep can live with
		}
	}
	if len(removed) > 0 {
		if err := atomicfile.SyncDir(l.blobDir()); err != nil {
			return removed, errcode.Wrap(errcode.RegistryError, err, "cannot sync %s", l.blobDir())
		}
	}
	return removed, nil
}

// --- registry ---

// tagPageSize is how many tags ListTags asks the registry for at once, and
// maxTagPage the bytes of one answer it reads: as much as an index, for a
// registry that ignores n and sends every tag at once.
const (
	tagPageSize = 1000
	maxTagPage  = MaxIndexSize
)

// ListTags lists the repository's tags (GET /v2/NAME/tags/list, page by
// page as the Link header says, at most MaxTags), then describes what each
// names (a HEAD each, several at a time). Tags that are not valid tag names
// are ignored: they cannot be put in a request safely.
func (r *Registry) ListTags(ctx context.Context) ([]TaggedManifest, error) {
	names, err := r.tagNames(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]TaggedManifest, len(names))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(8)
	for i, tag := range names {
		g.Go(func() error {
			return errcode.Safely(func() error { // a panic here must not end the process
				return r.withRetry(gctx, "resolving tag "+tag, 0, func(ctx context.Context) error {
					desc, err := r.resolve(ctx, tag, "")
					out[i] = TaggedManifest{Tag: tag, Descriptor: desc}
					return err
				})
			})
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	return out, nil
}

func (r *Registry) tagNames(ctx context.Context) ([]string, error) {
	next := r.url("tags", "list") + "?n=" + fmt.Sprint(tagPageSize)
	var names []string
	for next != "" {
		var page []string
		var link string
		err := r.withRetry(ctx, "listing the tags of "+r.where(), 0, func(ctx context.Context) error {
			var err error
			page, link, err = r.tagPage(ctx, next)
			return err
		})
		if err != nil {
			return nil, err
		}
		names = append(names, page...)
		if len(names) > MaxTags {
			return nil, errcode.New(errcode.InvalidInput, "%s has more than %d tags, more than vmsnap lists", r.where(), MaxTags)
		}
		if len(page) == 0 {
			break // a registry that links on without giving tags would loop
		}
		next = link
	}
	slices.Sort(names)
	return slices.Compact(names), nil
}

// tagPage fetches one page of the tag list and returns its valid tags and
// the next page's URL ("" on the last page).
func (r *Registry) tagPage(ctx context.Context, u string) ([]string, string, error) {
	resp, err := r.send(ctx, http.MethodGet, u, "application/json")
	if err != nil {
		return nil, "", err
	}
	defer drain(resp)
	if resp.StatusCode == http.StatusNotFound {
		return nil, "", nil // no repository yet: no tags
	}
	if err := transport.CheckError(resp, http.StatusOK); err != nil {
		return nil, "", err
	}
	b, err := readBounded(resp, maxTagPage, func(n int64) error {
		return errcode.New(errcode.InvalidInput, "a page of the tag list of %s is %d bytes, more than the %d vmsnap reads", r.where(), n, maxTagPage)
	})
	if err != nil {
		return nil, "", err
	}
	var list struct {
		Tags []string `json:"tags"`
	}
	if err := json.Unmarshal(b, &list); err != nil {
		return nil, "", errcode.Wrap(errcode.InvalidInput, err, "the tag list of %s is not valid JSON", r.where())
	}
	tags := slices.DeleteFunc(list.Tags, func(t string) bool { return !tagRE.MatchString(t) })
	next, err := r.nextPage(resp)
	return tags, next, err
}

// nextPage is the URL of the Link header's rel="next", resolved against the
// request, or "". It must stay on the same registry and repository's tag
// list: the registry's word is not enough to send credentials elsewhere.
func (r *Registry) nextPage(resp *http.Response) (string, error) {
	for _, l := range resp.Header.Values("Link") {
		target, params, ok := strings.Cut(l, ";")
		if !ok || !strings.Contains(strings.ReplaceAll(params, " ", ""), `rel="next"`) {
			continue
		}
		target = strings.Trim(strings.TrimSpace(target), "<>")
		u, err := resp.Request.URL.Parse(target)
		if err != nil || u.Host != resp.Request.URL.Host || u.Scheme != resp.Request.URL.Scheme ||
			u.Path != resp.Request.URL.Path {
			return "", errcode.New(errcode.InvalidInput, "registry %s links the next page of its tag list to %q, outside the tag list of %s", r.ref.Registry, target, r.where())
		}
		return u.String(), nil
	}
	return "", nil
}

// ResolveDigest describes the manifest d names (a HEAD, or a GET where the
// HEAD says too little).
func (r *Registry) ResolveDigest(ctx context.Context, d digest.Digest) (ocispec.Descriptor, error) {
	if _, err := ParseDigest(string(d)); err != nil {
		return ocispec.Descriptor{}, errcode.Wrap(errcode.InvalidInput, err, "invalid manifest digest %q", d)
	}
	var desc ocispec.Descriptor
	err := r.withRetry(ctx, "resolving manifest "+string(d), 0, func(ctx context.Context) error {
		var err error
		desc, err = r.resolve(ctx, string(d), d)
		return err
	})
	return desc, err
}

// DeleteManifest deletes the manifest by digest (DELETE
// /v2/NAME/manifests/DIGEST). Distribution removes the tags that name it
// with it; its blobs stay until the registry's own garbage collection. A
// registry that does not allow deletes is REGISTRY_ERROR with
// ErrDeletesDisabled in the chain.
func (r *Registry) DeleteManifest(ctx context.Context, d digest.Digest) error {
	if _, err := ParseDigest(string(d)); err != nil {
		return errcode.Wrap(errcode.InvalidInput, err, "invalid manifest digest %q", d)
	}
	return r.withRetry(ctx, "deleting manifest "+string(d), 0, func(ctx context.Context) error {
		rt, err := r.authTransport(ctx, &r.deleteRT, "pull,push,delete")
		if err != nil {
			return err
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodDelete, r.url("manifests", string(d)), nil)
		if err != nil {
			return errcode.Wrap(errcode.Internal, err, "building a registry request")
		}
		resp, err := (&http.Client{Transport: rt}).Do(req)
		if err != nil {
			return err
		}
		defer drain(resp)
		switch resp.StatusCode {
		case http.StatusAccepted, http.StatusOK, http.StatusNoContent, http.StatusNotFound:
			return nil // gone, now or before
		case http.StatusMethodNotAllowed:
			return &errcode.Error{Code: errcode.RegistryError, Err: ErrDeletesDisabled,
				Msg: fmt.Sprintf("registry %s refused to delete manifest %s from %s: this registry does not allow deletes: enable storage.delete in its config", r.ref.Registry, d, r.ref.Repository)}
		}
		return transport.CheckError(resp, http.StatusAccepted)
	})
}
