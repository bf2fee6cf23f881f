package ociimage

// The registry client's referrers: the referrers API where the registry
// has it, else the tag schema's fallback.

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Referrers lists the manifests whose subject is desc: through the
// registry's referrers API, or where it has none (distribution 2.8) the
// image index tagged sha256-HEX that writers keep instead.
func (r *Registry) Referrers(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if _, err := ParseDigest(string(desc.Digest)); err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "invalid manifest digest %q", desc.Digest)
	}
	var out []ocispec.Descriptor
	err := r.withRetry(ctx, "listing the referrers of "+string(desc.Digest), 0, func(ctx context.Context) error {
		var err error
		out, err = r.referrers(ctx, desc.Digest)
		return err
	})
	return out, err
}

func (r *Registry) referrers(ctx context.Context, d digest.Digest) ([]ocispec.Descriptor, error) {
	tooLarge := func(n int64) error {
		return errcode.New(errcode.InvalidInput, "the referrers list of %s in %s is %d bytes, more than the %d vmsnap reads", d, r.where(), n, MaxIndexSize)
	}
	resp, err := r.send(ctx, http.MethodGet, r.url("referrers", string(d)), ocispec.MediaTypeImageIndex)
	if err != nil {
		return nil, err
	}
	defer drain(resp)
	var b []byte
	switch {
	case resp.StatusCode == http.StatusOK && mediaType(resp.Header.Get("Content-Type")) == ocispec.MediaTypeImageIndex:
		if b, err = readBounded(resp, MaxIndexSize, tooLarge); err != nil {
			return nil, err
		}
	case resp.StatusCode == http.StatusOK, resp.StatusCode == http.StatusNotFound, resp.StatusCode == http.StatusBadRequest,
		resp.StatusCode == http.StatusMethodNotAllowed, resp.StatusCode == http.StatusNotAcceptable:
		// No referrers API: the tag schema.
		tag := strings.Replace(string(d), ":", "-", 1)
		fresp, err := r.send(ctx, http.MethodGet, r.url("manifests", tag), ocispec.MediaTypeImageIndex)
		if err != nil {
			return nil, err
		}
		defer drain(fresp)
		if fresp.StatusCode == http.StatusNotFound {
			return nil, nil
		}
		if err := transport.CheckError(fresp, http.StatusOK); err != nil {
			return nil, err
		}
		if b, err = readBounded(fresp, MaxIndexSize, tooLarge); err != nil {
			return nil, err
		}
	default:
		return nil, transport.CheckError(resp, http.StatusOK)
	}
	var idx ocispec.Index
	if err := json.Unmarshal(b, &idx); err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "the referrers list of %s in %s is not an image index", d, r.where())
	}
	var out []ocispec.Descriptor
	for _, e := range idx.Manifests {
		if _, err := ParseDigest(string(e.Digest)); err == nil && e.Size >= 0 {
			out = append(out, e)
		}
	}
	return out, nil
}
