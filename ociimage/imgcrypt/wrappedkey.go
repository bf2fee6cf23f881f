package imgcrypt

// A layer's wrapped keys (the JWEs of ociimage.AnnotationEncKeysJWE): the
// recipients they name, and opening them with the keys given.

import (
	"encoding/base64"
	"encoding/json"
	"slices"
	"strings"

	"github.com/go-jose/go-jose/v4"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// wrappedKey is one JWE of AnnotationEncKeysJWE (it may hold several,
// comma-separated).
type wrappedKey []byte

func wrappedKeys(l ocispec.Descriptor) []wrappedKey {
	var out []wrappedKey
	for _, s := range strings.Split(l.Annotations[ociimage.AnnotationEncKeysJWE], ",") {
		if b, err := base64.StdEncoding.DecodeString(s); err == nil && len(b) > 0 {
			out = append(out, b)
		}
	}
	return out
}

func (w wrappedKey) recipients() []string {
	type hdr struct {
		Kid string `json:"kid"`
		Alg string `json:"alg"`
	}
	var j struct {
		Protected  string `json:"protected"`
		Header     hdr    `json:"header"`
		Recipients []struct {
			Header hdr `json:"header"`
		} `json:"recipients"`
	}
	if json.Unmarshal(w, &j) != nil {
		return nil
	}
	hs := []hdr{j.Header}
	// One recipient's header is in the protected header (go-jose's flat form).
	if b, err := base64.RawURLEncoding.DecodeString(j.Protected); err == nil {
		var p hdr
		if json.Unmarshal(b, &p) == nil {
			hs = append(hs, p)
		}
	}
	for _, r := range j.Recipients {
		hs = append(hs, r.Header)
	}
	var ids []string
	for _, h := range hs {
		switch {
		case h.Kid != "":
			ids = append(ids, h.Kid)
		case h.Alg != "":
			ids = append(ids, "a key without an ID ("+h.Alg+")")
		}
	}
	return ids
}

// The JWE algorithms vmsnap reads (and unwrapCEK implements).
var (
	unwrapAlgorithms  = []jose.KeyAlgorithm{jose.RSA_OAEP, jose.RSA_OAEP_256, jose.ECDH_ES_A128KW, jose.ECDH_ES_A192KW, jose.ECDH_ES_A256KW}
	contentAlgorithms = []jose.ContentEncryption{jose.A128GCM, jose.A192GCM, jose.A256GCM, jose.A128CBC_HS256, jose.A192CBC_HS384, jose.A256CBC_HS512}
)

// unwrap returns the layer's private options with the first of keys that
// opens it, unwrapping CEKs through cache. Keys whose ID the JWE names are
// tried; a JWE that names none has every key tried.
func (w wrappedKey) unwrap(keys []DecryptionKey, cache *unwrapCache) (privateOpts, bool) {
	obj, err := jose.ParseEncrypted(string(w), unwrapAlgorithms, contentAlgorithms)
	if err != nil {
		return privateOpts{}, false
	}
	named := w.recipients()
	for _, k := range keys {
		if !slices.Contains(named, k.ID) && slices.ContainsFunc(named, func(s string) bool { return strings.HasPrefix(s, "sha256:") }) {
			continue
		}
		_, _, plain, err := obj.DecryptMulti(cachedKey{key: k, cache: cache})
		if err != nil {
			continue
		}
		var p privateOpts
		err = json.Unmarshal(plain, &p)
		clear(plain)
		if err == nil {
			return p, true
		}
	}
	return privateOpts{}, false
}

// decryptLayer unwraps an encrypted layer's key with keys and returns it
// with the layer's plaintext descriptor. A layer no key
// opens is AUTH_FAILED, naming the keys it is encrypted for and those given.
func decryptLayer(l ocispec.Descriptor, keys []DecryptionKey, cache *unwrapCache) (ocispec.Descriptor, layerKey, error) {
	pubData, err := base64.StdEncoding.DecodeString(l.Annotations[ociimage.AnnotationEncPubOpts])
	var pub publicOpts
	if err == nil {
		err = json.Unmarshal(pubData, &pub)
	}
	if err != nil || pub.CipherType != cipherAES256CTR {
		return ocispec.Descriptor{}, layerKey{}, errcode.New(errcode.InvalidInput,
			"encrypted layer %s: its cipher (%s) is not %s, the one vmsnap reads", l.Digest, ociimage.AnnotationEncPubOpts, cipherAES256CTR)
	}
	for _, w := range wrappedKeys(l) {
		p, ok := w.unwrap(keys, cache)
		if !ok {
			continue
		}
		k, err := makeLayerKey(p.SymmetricKey, p.CipherOptions["nonce"])
		if err != nil {
			return ocispec.Descriptor{}, layerKey{}, err
		}
		if _, err := ociimage.ParseDigest(string(p.Digest)); err != nil {
			return ocispec.Descriptor{}, layerKey{}, errcode.New(errcode.InvalidInput, "encrypted layer %s: its wrapped plaintext digest is invalid", l.Digest)
		}
		plain := ocispec.Descriptor{
			MediaType: strings.TrimSuffix(l.MediaType, ociimage.MediaTypeEncryptedSuffix),
			Digest:    p.Digest, Size: l.Size, URLs: l.URLs,
		}
		for a, v := range l.Annotations {
			if !strings.HasPrefix(a, ociimage.AnnotationEncPrefix) {
				if plain.Annotations == nil {
					plain.Annotations = map[string]string{}
				}
				plain.Annotations[a] = v
			}
		}
		return plain, k, nil
	}
	if spent, budget := cache.overBudget(); spent {
		return ocispec.Descriptor{}, layerKey{}, errcode.New(errcode.InvalidInput,
			"encrypted layer %s: the image's wrapped keys took more than %d private-key operations to try, more than any image needs (its JWEs list forged recipients?): refused", l.Digest, budget)
	}
	return ocispec.Descriptor{}, layerKey{}, notForTheseKeys(l, keys)
}

// notForTheseKeys is the AUTH_FAILED of an encrypted layer that none of
// keys opens (or no key at all was given).
func notForTheseKeys(l ocispec.Descriptor, keys []DecryptionKey) error {
	for_ := strings.Join(EncryptedFor(l), ", ")
	if for_ == "" {
		for_ = "no recognisable recipient"
	}
	if len(keys) == 0 {
		return errcode.New(errcode.AuthFailed,
			"the image is encrypted (layer %s) for the keys %s, and no decryption key was given: give the private key of one of them (%s)",
			l.Digest, for_, errcode.Field("decryptionKey"))
	}
	return errcode.New(errcode.AuthFailed,
		"the image is encrypted (layer %s) for the keys %s; none of the decryption keys given (%s) opens it: give the private key of one of them (%s)",
		l.Digest, for_, strings.Join(keyIDs(keys), ", "), errcode.Field("decryptionKey"))
}
