package ociimage

import (
	_ "crypto/sha256" // go-digest computes sha256 only if the hash is linked in
	"regexp"
	"strings"

	"github.com/opencontainers/go-digest"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Reference names a snapshot image: an OCI image layout on disk (oci:DIR) or
// a repository in a registry (HOST[:PORT]/REPO), optionally with a tag or a
// digest. A parsed Reference has at most one of Tag and Digest.
type Reference struct {
	// Layout is the directory of an OCI image layout, as written by the
	// user; empty for a registry reference.
	Layout string
	// Registry is HOST[:PORT] and Repository the slash-separated path of a
	// registry reference; both empty for a layout.
	Registry   string
	Repository string

	Tag    string
	Digest digest.Digest
}

// referenceForms is appended to every parse error so the user sees the
// forms that work.
const referenceForms = "use oci:DIR[:TAG], oci:DIR@sha256:HEX or HOST[:PORT]/REPO[:TAG|@sha256:HEX], " +
	"for example oci:/var/lib/vmsnap/web:before-upgrade or registry.example.com/vms/web:v1"

var (
	tagRE = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$`)
	// A registry host name or IPv4 address, or a bracketed IPv6 address,
	// with an optional port.
	hostRE = regexp.MustCompile(`^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$`)
	// One path component of a repository name (OCI distribution spec).
	repoComponentRE = regexp.MustCompile(`^[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*$`)
)

// maxRepoNameLen is the longest HOST/REPO that registries commonly accept.
const maxRepoNameLen = 255

// ParseReference parses an image reference given by a user. Errors are
// INVALID_INPUT and show the accepted forms.
func ParseReference(s string) (Reference, error) {
	if s == "" {
		return Reference{}, errcode.New(errcode.InvalidInput, "empty image reference; %s", referenceForms)
	}
	if dir, ok := strings.CutPrefix(s, "oci:"); ok {
		return parseLayoutReference(s, dir)
	}
	return parseRegistryReference(s)
}

func parseLayoutReference(s, rest string) (Reference, error) {
	var r Reference
	// A digest follows the last '@' unless that '@' is part of a directory
	// name (then a '/' follows it).
	if i := strings.LastIndexByte(rest, '@'); i >= 0 && !strings.Contains(rest[i+1:], "/") {
		d, err := ParseDigest(rest[i+1:])
		if err != nil {
			return Reference{}, errcode.Wrap(errcode.InvalidInput, err, "invalid digest in image reference %q (%s)", s, referenceForms)
		}
		r.Digest, rest = d, rest[:i]
	}
	// Likewise a tag follows the last ':' unless a '/' follows it, so that
	// oci:./a:b/c is the directory a:b/c.
	if i := strings.LastIndexByte(rest, ':'); i >= 0 && !strings.Contains(rest[i+1:], "/") {
		r.Tag, rest = rest[i+1:], rest[:i]
		if err := checkTag(s, r.Tag); err != nil {
			return Reference{}, err
		}
	}
	if rest == "" {
		return Reference{}, errcode.New(errcode.InvalidInput, "image reference %q names no directory; %s", s, referenceForms)
	}
	if r.Tag != "" && r.Digest != "" {
		return Reference{}, bothTagAndDigest(s)
	}
	r.Layout = rest
	return r, nil
}

func parseRegistryReference(s string) (Reference, error) {
	host, rest, ok := strings.Cut(s, "/")
	// Like docker, the first component is a registry only if it looks like
	// a host; "ubuntu" or "library/ubuntu" would silently mean Docker Hub
	// there, and vmsnap does not guess.
	if !ok || rest == "" || !(strings.ContainsAny(host, ".:") || host == "localhost") {
		return Reference{}, errcode.New(errcode.InvalidInput, "%q is not an image reference; %s", s, referenceForms)
	}
	if !hostRE.MatchString(host) {
		return Reference{}, errcode.New(errcode.InvalidInput, "invalid registry host %q in image reference %q; %s", host, s, referenceForms)
	}
	r := Reference{Registry: host}
	if repo, d, ok := strings.Cut(rest, "@"); ok {
		dg, err := ParseDigest(d)
		if err != nil {
			return Reference{}, errcode.Wrap(errcode.InvalidInput, err, "invalid digest in image reference %q (%s)", s, referenceForms)
		}
		r.Digest, rest = dg, repo
	}
	// The host is already cut off, so a ':' here can only start a tag.
	if i := strings.LastIndexByte(rest, ':'); i >= 0 {
		r.Tag, rest = rest[i+1:], rest[:i]
		if err := checkTag(s, r.Tag); err != nil {
			return Reference{}, err
		}
	}
	if r.Tag != "" && r.Digest != "" {
		return Reference{}, bothTagAndDigest(s)
	}
	for c := range strings.SplitSeq(rest, "/") {
		if !repoComponentRE.MatchString(c) {
			return Reference{}, errcode.New(errcode.InvalidInput,
				"invalid repository %q in image reference %q: each path component must be lowercase letters and digits, separated by '.', '_', '__' or '-'; %s",
				rest, s, referenceForms)
		}
	}
	if len(host)+1+len(rest) > maxRepoNameLen {
		return Reference{}, errcode.New(errcode.InvalidInput, "repository name %s/%s is longer than %d characters; choose a shorter one", host, rest, maxRepoNameLen)
	}
	r.Repository = rest
	return r, nil
}

func checkTag(ref, tag string) error {
	if !tagRE.MatchString(tag) {
		return errcode.New(errcode.InvalidInput,
			"invalid tag %q in image reference %q: a tag is 1 to 128 letters, digits, '_', '.' or '-', and does not start with '.' or '-'", tag, ref)
	}
	return nil
}

func bothTagAndDigest(ref string) error {
	return errcode.New(errcode.InvalidInput, "image reference %q has both a tag and a digest; give one of them, REF:TAG or REF@sha256:HEX", ref)
}

// ParseDigest parses a digest, and accepts only sha256 ones: the layout
// keeps blobs under blobs/sha256, and vmsnap writes nothing else.
func ParseDigest(s string) (digest.Digest, error) {
	d, err := digest.Parse(s)
	if err != nil {
		return "", err
	}
	if d.Algorithm() != digest.SHA256 {
		return "", errcode.New(errcode.InvalidInput, "digest %s is not sha256; vmsnap supports only sha256 digests", s)
	}
	return d, nil
}

// String returns the reference in the form ParseReference accepts.
func (r Reference) String() string {
	var b strings.Builder
	if r.IsLayout() {
		b.WriteString("oci:")
		b.WriteString(r.Layout)
	} else {
		b.WriteString(r.Registry)
		b.WriteString("/")
		b.WriteString(r.Repository)
	}
	switch {
	case r.Digest != "":
		b.WriteString("@")
		b.WriteString(r.Digest.String())
	case r.Tag != "":
		b.WriteString(":")
		b.WriteString(r.Tag)
	}
	return b.String()
}

// WithDigest returns the reference pinned to one manifest, REF@sha256:HEX.
// The tag is dropped: a pinned reference must not depend on where a tag
// points now.
func (r Reference) WithDigest(d digest.Digest) Reference {
	r.Tag = ""
	r.Digest = d
	return r
}

// WithTag returns the reference with tag instead of its tag or digest.
func (r Reference) WithTag(tag string) Reference {
	r.Tag, r.Digest = tag, ""
	return r
}

// IsDigest reports whether the reference names a manifest by digest.
func (r Reference) IsDigest() bool { return r.Digest != "" }

// IsLayout reports whether the reference is an OCI image layout on disk.
func (r Reference) IsLayout() bool { return r.Layout != "" }
