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

	"github.com/opencontainers/go-digest"

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
