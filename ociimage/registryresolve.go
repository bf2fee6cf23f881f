package ociimage

// The registry client's resolution of a reference (a tag, or a digest) to
// a manifest's descriptor, with the errors of one that is not there.

import (
	"context"
	"encoding/json"
	"net/http"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Resolve returns the descriptor of the manifest the reference names: HEAD,
// and a GET where the registry's HEAD does not tell enough.
func (r *Registry) Resolve(ctx context.Context) (ocispec.Descriptor, error) {
	return r.resolveRef(ctx, r.ref)
}

// ResolveTag is Repository.ResolveTag.
func (r *Registry) ResolveTag(ctx context.Context, tag string) (ocispec.Descriptor, error) {
	return r.resolveRef(ctx, r.ref.WithTag(tag))
}

// resolveRef is Resolve for ref, a reference into this repository.
func (r *Registry) resolveRef(ctx context.Context, ref Reference) (ocispec.Descriptor, error) {
	if err := ctx.Err(); err != nil {
		return ocispec.Descriptor{}, err
	}
	ident, what := ref.Tag, "resolving tag "+ref.Tag
	switch {
	case ref.IsDigest():
		ident, what = string(ref.Digest), "resolving manifest "+string(ref.Digest)
	case ref.Tag == "":
		return ocispec.Descriptor{}, errcode.New(errcode.InvalidInput,
			"%s names neither a tag nor a digest; use %s:TAG or %s@sha256:HEX", ref, ref, ref)
	}
	var desc ocispec.Descriptor
	err := r.withRetry(ctx, what, 0, func(ctx context.Context) error {
		var err error
		desc, err = r.resolve(ctx, ident, ref.Digest)
		return err
	})
	return desc, err
}

// resolve describes the manifest ident (a tag, or the digest want) names.
func (r *Registry) resolve(ctx context.Context, ident string, want digest.Digest) (ocispec.Descriptor, error) {
	resp, err := r.send(ctx, http.MethodHead, r.url("manifests", ident), manifestAccept)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	drain(resp)
	switch resp.StatusCode {
	case http.StatusOK:
		d, derr := ParseDigest(resp.Header.Get("Docker-Content-Digest"))
		mt := mediaType(resp.Header.Get("Content-Type"))
		switch {
		case want != "" && derr == nil && d != want:
			return ocispec.Descriptor{}, errcode.New(errcode.DigestMismatch,
				"registry %s answers manifest %s with digest %s", r.ref.Registry, want, d)
		case want != "":
			d, derr = want, nil
		}
		if derr == nil && mt != "" && resp.ContentLength >= 0 {
			if resp.ContentLength > MaxManifestSize {
				return ocispec.Descriptor{}, tooLargeManifest(ident, resp.ContentLength)
			}
			return ocispec.Descriptor{MediaType: mt, Digest: d, Size: resp.ContentLength}, nil
		}
	case http.StatusNotFound:
		return ocispec.Descriptor{}, r.notFound(ident, want != "")
	case http.StatusUnauthorized, http.StatusForbidden:
		return ocispec.Descriptor{}, transport.CheckError(resp, http.StatusOK)
	}
	// The HEAD did not say enough (no digest or length, or a registry that
	// does not answer HEAD): fetch the manifest and describe it.
	resp, err = r.send(ctx, http.MethodGet, r.url("manifests", ident), manifestAccept)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	defer drain(resp)
	if resp.StatusCode == http.StatusNotFound {
		return ocispec.Descriptor{}, r.notFound(ident, want != "")
	}
	if err := transport.CheckError(resp, http.StatusOK); err != nil {
		return ocispec.Descriptor{}, err
	}
	b, err := readBounded(resp, MaxManifestSize, func(n int64) error { return tooLargeManifest(ident, n) })
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	d := digest.FromBytes(b)
	if hdr := resp.Header.Get("Docker-Content-Digest"); (want != "" && d != want) || (hdr != "" && hdr != string(d)) {
		return ocispec.Descriptor{}, errcode.New(errcode.DigestMismatch,
			"the manifest %s from registry %s has digest %s; the registry returned corrupt data", ident, r.ref.Registry, d)
	}
	mt := mediaType(resp.Header.Get("Content-Type"))
	if mt == "" {
		var head struct {
			MediaType string `json:"mediaType"`
		}
		_ = json.Unmarshal(b, &head)
		mt = head.MediaType
	}
	return ocispec.Descriptor{MediaType: mt, Digest: d, Size: int64(len(b))}, nil
}

func (r *Registry) notFound(ident string, isDigest bool) error {
	if isDigest {
		return notFound{errcode.New(errcode.RegistryError, "no manifest %s in %s; check the digest, or use a tag", ident, r.where())}
	}
	return notFound{errcode.New(errcode.RegistryError, "no tag %s in %s", ident, r.where())}
}

func tooLargeManifest(what string, n int64) error {
	return errcode.New(errcode.InvalidInput, "%s is %d bytes, more than the %d a manifest may have; it was not written by vmsnap", what, n, MaxManifestSize)
}
