package ociimage

// What manifests and image indexes share: their head (schema version
// and media type), and their JSON, bounded in size when encoded and
// checked when decoded.

import (
	"bytes"
	"encoding/json"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// encodeChecked returns the JSON of a checked manifest or index (what)
// and the descriptor that names it; advice ends the message of one too
// large. Errors are INVALID_INPUT.
func encodeChecked(v any, what, advice, mediaType, artifactType string) ([]byte, ocispec.Descriptor, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, ocispec.Descriptor{}, errcode.Wrap(errcode.InvalidInput, err, "cannot encode %s", what)
	}
	if len(b) > MaxManifestSize {
		return nil, ocispec.Descriptor{}, errcode.New(errcode.InvalidInput,
			"%s is %d bytes, more than the %d a manifest may have%s", what, len(b), MaxManifestSize, advice)
	}
	return b, ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(b), Size: int64(len(b)), ArtifactType: artifactType}, nil
}

// decodeChecked parses the verified bytes of a manifest or an index
// (what) and checks them with check. Errors are INVALID_INPUT.
func decodeChecked[T any](b []byte, what string, check func(T) error) (T, error) {
	var v T
	if err := json.NewDecoder(bytes.NewReader(b)).Decode(&v); err != nil {
		return v, errcode.Wrap(errcode.InvalidInput, err, "%s is not valid JSON", what)
	}
	return v, check(v)
}

// completeHead sets an unset schema version to 2 and an unset media type
// to want: what a manifest or an index vmsnap writes has.
func completeHead(schemaVersion *int, mediaType *string, want string) {
	if *schemaVersion == 0 {
		*schemaVersion = 2
	}
	if *mediaType == "" {
		*mediaType = want
	}
}

// checkHead refuses a manifest or an index (what) that is not of schema
// version 2 and media type want.
func checkHead(what string, schemaVersion int, mediaType, want string) error {
	if schemaVersion != 2 {
		return errcode.New(errcode.InvalidInput, "%s has schemaVersion %d, not 2", what, schemaVersion)
	}
	if mediaType != want {
		return errcode.New(errcode.InvalidInput, "%s has media type %q, not %s", what, clip(mediaType), want)
	}
	return nil
}
