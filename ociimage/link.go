package ociimage

import (
	"path/filepath"
	"strings"

	"github.com/opencontainers/go-digest"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Links between the images of one checkpoint that survive a copy: a part
// in another repository is named by that repository's path relative to the
// registry, never by a host, and resolved against the registry the
// checkpoint is read from. An OCI layout directory has no registry; the
// directory it is in plays that role, so a layout links only a layout
// beside it, by its name.

// SameRepository says whether two references name the same repository (a
// registry's host compared without case, a layout's directory made
// absolute), whatever their tags or digests.
func SameRepository(a, b Reference) bool {
	if a.IsLayout() || b.IsLayout() {
		x, errx := filepath.Abs(a.Layout)
		y, erry := filepath.Abs(b.Layout)
		return a.IsLayout() && b.IsLayout() && errx == nil && erry == nil && x == y
	}
	return strings.EqualFold(a.Registry, b.Registry) && a.Repository == b.Repository
}

// RelativeLink is the link from a checkpoint stored at from to the image
// to (pinned by digest) in another repository: REPOSITORY@sha256:HEX. It is
// USAGE when no such link exists: to is on another registry, or is a layout
// that is not beside from's, or one is a layout and the other not.
func RelativeLink(from, to Reference) (string, error) {
	if !to.IsDigest() {
		return "", errcode.New(errcode.Internal, "RelativeLink: %s is not pinned", to)
	}
	switch {
	case from.IsLayout() && to.IsLayout():
		a, erra := filepath.Abs(from.Layout)
		b, errb := filepath.Abs(to.Layout)
		if erra == nil && errb == nil && filepath.Dir(a) == filepath.Dir(b) {
			return filepath.Base(b) + "@" + to.Digest.String(), nil
		}
	case !from.IsLayout() && !to.IsLayout() && strings.EqualFold(from.Registry, to.Registry):
		return to.Repository + "@" + to.Digest.String(), nil
	}
	return "", errcode.New(errcode.Usage,
		"%s cannot be linked from a checkpoint at %s so that a copy keeps the link: store it in the same repository (or, across repositories, on the same registry; for a layout, in a directory beside it)",
		to.WithDigest(""), from.WithDigest("").WithTag(""))
}

// maxLinkLen bounds a link: the longest repository name a reference may
// have (which also bounds a layout's directory name), '@' and a sha256
// digest.
const maxLinkLen = maxRepoNameLen + 1 + len("sha256:") + 64

// ResolveLink resolves a link (REPOSITORY@sha256:HEX) against base, the
// repository the checkpoint that holds it was read from. A link that is not
// of that form, or whose repository could lead anywhere but a repository
// of base's registry (a layout beside base's), is INVALID_INPUT.
func ResolveLink(base Reference, link string) (Reference, error) {
	at := strings.LastIndexByte(link, '@')
	if at <= 0 || len(link) > maxLinkLen {
		return Reference{}, errcode.New(errcode.InvalidInput, "link %q is not REPOSITORY@sha256:HEX (at most %d bytes)", clip(link), maxLinkLen)
	}
	path := link[:at]
	d, err := ParseDigest(link[at+1:])
	if err != nil {
		return Reference{}, errcode.Wrap(errcode.InvalidInput, err, "link %q", clip(link))
	}
	if base.IsLayout() {
		return siblingLayout(base, path, d, link)
	}
	// The same grammar as a reference's repository: lowercase components,
	// no "." or "..", no host.
	ref, err := ParseReference(base.Registry + "/" + path + "@" + d.String())
	if err != nil || ref.Repository != path {
		return Reference{}, errcode.New(errcode.InvalidInput, "link %q does not name a repository path of the registry (lowercase components, no host)", link)
	}
	return ref, nil
}

// siblingLayout is the layout directory name beside base's, pinned to d.
func siblingLayout(base Reference, name string, d digest.Digest, link string) (Reference, error) {
	if name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
		return Reference{}, errcode.New(errcode.InvalidInput, "link %q does not name a directory beside the layout %s", link, base.Layout)
	}
	dir := filepath.Join(filepath.Dir(filepath.Clean(base.Layout)), name)
	return Reference{Layout: dir, Digest: d}, nil
}
