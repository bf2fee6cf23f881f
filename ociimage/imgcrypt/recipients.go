package imgcrypt

import (
	"slices"
	"strings"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/ociimage"
)

// EncryptsFor lists, sorted, the KeyIDs of the recipients repo encrypts
// the layers put through it for (Encrypt), or nil if it stores them in
// the clear.
func EncryptsFor(repo ociimage.Repository) []string {
	for {
		if e, ok := repo.(*encrypting); ok {
			ids := make([]string, 0, len(e.o.Recipients))
			for _, r := range e.o.Recipients {
				if !slices.Contains(ids, r.ID) {
					ids = append(ids, r.ID)
				}
			}
			slices.Sort(ids)
			return ids
		}
		u, ok := repo.(ociimage.Unwrapper)
		if !ok {
			return nil
		}
		repo = u.Unwrap()
	}
}

// LayersEncryptedFor lists, sorted, the KeyIDs a manifest's stored layers
// are encrypted for (EncryptedFor), or nil if every one is in the clear.
// uniform is false when the layers do not all share one answer (some in
// the clear, or encrypted for different keys): no one set of keys reads
// exactly them.
func LayersEncryptedFor(layers []ocispec.Descriptor) (ids []string, uniform bool) {
	for i, l := range layers {
		var these []string
		if IsEncrypted(l) {
			these = EncryptedFor(l)
			if these == nil {
				these = []string{} // encrypted, for no one named
			}
		}
		if i == 0 {
			ids = these
		} else if !slices.Equal(ids, these) || (ids == nil) != (these == nil) {
			return nil, false
		}
	}
	return ids, true
}

// IsEncrypted reports whether a layer is encrypted in the OCI image
// encryption convention.
func IsEncrypted(l ocispec.Descriptor) bool {
	return strings.HasSuffix(l.MediaType, ociimage.MediaTypeEncryptedSuffix)
}

// CheckDecrypted refuses layers that are still encrypted (the repository
// was opened without a key that opens them) with AUTH_FAILED, naming the
// keys they are encrypted for: what a reader checks before fetching any.
func CheckDecrypted(layers []ocispec.Descriptor) error {
	for _, l := range layers {
		if IsEncrypted(l) {
			return notForTheseKeys(l, nil)
		}
	}
	return nil
}

// EncryptedFor lists the KeyIDs an encrypted layer's key is wrapped for, as
// its JWE headers name them ("kid"; a recipient without one is listed by
// its algorithm). Nothing secret is needed to read them.
func EncryptedFor(l ocispec.Descriptor) []string {
	var ids []string
	for _, w := range wrappedKeys(l) {
		for _, r := range w.recipients() {
			if !slices.Contains(ids, r) {
				ids = append(ids, r)
			}
		}
	}
	slices.Sort(ids)
	return ids
}
