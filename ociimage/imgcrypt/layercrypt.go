package imgcrypt

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"slices"
	"strings"

	"github.com/go-jose/go-jose/v4"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// The layer cipher of the OCI image encryption convention (ocicrypt's
// blockcipher): AES-256 in CTR mode, then HMAC-SHA256 of the ciphertext
// keyed with the same key. The ciphertext is as long as the plaintext.
const cipherAES256CTR = "AES_256_CTR_HMAC_SHA256"

// publicOpts is the JSON of AnnotationEncPubOpts.
type publicOpts struct {
	CipherType    string            `json:"cipher"`
	Hmac          []byte            `json:"hmac"`
	CipherOptions map[string][]byte `json:"cipheroptions"`
}

// privateOpts is what JWE wraps for the recipients.
type privateOpts struct {
	SymmetricKey  []byte            `json:"symkey"`
	Digest        digest.Digest     `json:"digest"` // of the plaintext
	CipherOptions map[string][]byte `json:"cipheroptions"`
}

// layerKey is one layer's key and CTR nonce.
type layerKey struct {
	block cipher.Block
	key   []byte
	nonce []byte
}

// newLayerKey makes the key of the layer whose plaintext digest is plain:
// random, or with a dedup secret derived from it and plain, so that equal
// layers encrypt to equal blobs (see EncryptOptions.DedupSecret).
func newLayerKey(plain digest.Digest, dedupSecret []byte) (layerKey, error) {
	key, nonce := make([]byte, 32), make([]byte, aes.BlockSize)
	if dedupSecret != nil {
		copy(key, derive(dedupSecret, "vmsnap layer key", plain))
		copy(nonce, derive(dedupSecret, "vmsnap layer nonce", plain))
	} else {
		if _, err := rand.Read(key); err != nil {
			return layerKey{}, errcode.Wrap(errcode.Internal, err, "generating a layer key")
		}
		if _, err := rand.Read(nonce); err != nil {
			return layerKey{}, errcode.Wrap(errcode.Internal, err, "generating a layer nonce")
		}
	}
	return makeLayerKey(key, nonce)
}

func derive(secret []byte, label string, d digest.Digest) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(label))
	m.Write([]byte{0})
	m.Write([]byte(d))
	return m.Sum(nil)
}

func makeLayerKey(key, nonce []byte) (layerKey, error) {
	if len(key) != 32 || len(nonce) != aes.BlockSize {
		return layerKey{}, errcode.New(errcode.InvalidInput, "a layer key of %d bytes and nonce of %d bytes: %s needs 32 and 16", len(key), len(nonce), cipherAES256CTR)
	}
	b, err := aes.NewCipher(key)
	if err != nil {
		return layerKey{}, errcode.Wrap(errcode.Internal, err, "layer cipher")
	}
	return layerKey{block: b, key: key, nonce: nonce}, nil
}

// xorAt XORs src, the bytes at offset off of a layer, with the key stream
// into dst (CTR: encryption and decryption are the same).
func (k layerKey) xorAt(dst, src []byte, off int64) {
	iv := make([]byte, aes.BlockSize)
	// The counter is the nonce as a 128-bit big-endian number plus the
	// block index, as crypto/cipher's CTR counts.
	hi, lo := binary.BigEndian.Uint64(k.nonce[:8]), binary.BigEndian.Uint64(k.nonce[8:])
	blocks := uint64(off) / aes.BlockSize
	nlo := lo + blocks
	if nlo < lo {
		hi++
	}
	binary.BigEndian.PutUint64(iv[:8], hi)
	binary.BigEndian.PutUint64(iv[8:], nlo)
	s := cipher.NewCTR(k.block, iv)
	if skip := int(uint64(off) % aes.BlockSize); skip > 0 {
		var pad [aes.BlockSize]byte
		s.XORKeyStream(pad[:skip], pad[:skip])
	}
	s.XORKeyStream(dst, src)
}

// encrypt encrypts a whole layer, plain, into ct (as long), a block at a
// time, and gives each block's plaintext and ciphertext to hash while
// both are still in the cache.
func (k layerKey) encrypt(ct, plain []byte, hash func(plain, ct []byte)) {
	s := k.stream()
	for off := 0; off < len(plain); off += cryptBlock {
		end := min(off+cryptBlock, len(plain))
		s.XORKeyStream(ct[off:end], plain[off:end])
		hash(plain[off:end], ct[off:end])
	}
}

// stream is the key stream from offset 0.
func (k layerKey) stream() cipher.Stream { return cipher.NewCTR(k.block, k.nonce) }

// decryptTo decrypts a whole layer in place and reports whether the
// plaintext's digest is want: block by block, each hashed while it is
// still in the cache.
func (k layerKey) decryptTo(ct []byte, want digest.Digest) bool {
	h, s := sha256.New(), k.stream()
	for off := 0; off < len(ct); off += cryptBlock {
		b := ct[off:min(off+cryptBlock, len(ct))]
		s.XORKeyStream(b, b)
		h.Write(b)
	}
	return digest.NewDigest(digest.SHA256, h) == want
}

// annotations wraps the layer's key for the sealer's recipients and
// returns the annotations of the encrypted layer.
func (k layerKey) annotations(plain digest.Digest, mac []byte, s *sealer) (map[string]string, error) {
	priv, err := json.Marshal(privateOpts{SymmetricKey: k.key, Digest: plain, CipherOptions: map[string][]byte{"nonce": k.nonce}})
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "encoding a layer's private options")
	}
	defer clear(priv)
	jwe, err := s.seal(priv)
	if err != nil {
		return nil, err
	}
	// The HMAC goes in both places ocicrypt's versions have read it from.
	pub, err := json.Marshal(publicOpts{CipherType: cipherAES256CTR, Hmac: mac, CipherOptions: map[string][]byte{"hmac": mac}})
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "encoding a layer's public options")
	}
	return map[string]string{
		ociimage.AnnotationEncKeysJWE: base64.StdEncoding.EncodeToString([]byte(jwe)),
		ociimage.AnnotationEncPubOpts: base64.StdEncoding.EncodeToString(pub),
	}, nil
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
