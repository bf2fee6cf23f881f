package imgcrypt

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"hash"
	"strings"
	"sync"

	"github.com/go-jose/go-jose/v4"
	josecipher "github.com/go-jose/go-jose/v4/cipher"
	"github.com/opencontainers/go-digest"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// The layer keys' wrapping (JWE, RFC 7516) is done here rather than by
// go-jose's Encrypter and private-key decrypters, for one reason: cost. A
// state image has a layer per chunk, hundreds of them, and go-jose makes a
// fresh content-encryption key (CEK) for every JWE, so that a restore paid
// one RSA private-key operation (about 1.2 ms on the bench machine) per
// layer. A sealer instead wraps one random CEK for every recipient once,
// and seals every layer's private options under it with a random 96-bit
// IV: standard JWEs (go-jose and ocicrypt read them as any other) that
// share their encrypted_key. The reader unwraps each distinct
// (key, recipient header, encrypted_key) once (unwrapCache).
//
// Security: the CEK only ever protects layer keys of one Encrypt
// repository (one checkpoint), which a recipient's private key opens all
// of anyway; AES-GCM with random 96-bit IVs is safe far beyond
// maxSealsPerCEK messages per key (NIST SP 800-38D allows 2^32). A reader
// who holds no key learns only that the layers were wrapped together,
// which the manifest that lists them says already.

// contentEncryption is the JWE "enc" of the wrapped layer keys.
const contentEncryption = jose.A256GCM

// maxSealsPerCEK bounds how many JWEs one CEK seals before a sealer makes
// a new one (a checkpoint of 64 GiB in 1 MiB chunks stays under it).
const maxSealsPerCEK = 1 << 16

// sealer wraps layer keys for a fixed set of recipients.
type sealer struct {
	recipients []Recipient
	mu         sync.Mutex
	cur        *sealKey
}

// sealKey is one CEK, its cipher, and the JWE parts that go with it in
// every message it seals.
type sealKey struct {
	aead      cipher.AEAD
	protected string // base64url of the protected header: the AAD
	// Exactly one of these: the flattened form of a single recipient
	// (alg and kid are in the protected header) or the general form.
	encryptedKey string
	recipients   []jweRecipient
	uses         int
}

type jweRecipient struct {
	Header       map[string]any `json:"header"`
	EncryptedKey string         `json:"encrypted_key"`
}

type jweJSON struct {
	Protected    string         `json:"protected"`
	EncryptedKey string         `json:"encrypted_key,omitempty"`
	Recipients   []jweRecipient `json:"recipients,omitempty"`
	IV           string         `json:"iv"`
	Ciphertext   string         `json:"ciphertext"`
	Tag          string         `json:"tag"`
}

func newSealer(recipients []Recipient) *sealer { return &sealer{recipients: recipients} }

// seal returns plain encrypted for every recipient, as a JWE in its JSON
// serialization (go-jose's: flattened for one recipient).
func (s *sealer) seal(plain []byte) (string, error) {
	k, err := s.key()
	if err != nil {
		return "", err
	}
	iv := make([]byte, k.aead.NonceSize())
	if _, err := rand.Read(iv); err != nil {
		return "", errcode.Wrap(errcode.Internal, err, "generating a JWE IV")
	}
	sealed := k.aead.Seal(nil, iv, plain, []byte(k.protected))
	ct, tag := sealed[:len(sealed)-k.aead.Overhead()], sealed[len(sealed)-k.aead.Overhead():]
	b64 := base64.RawURLEncoding.EncodeToString
	out, err := json.Marshal(jweJSON{
		Protected: k.protected, EncryptedKey: k.encryptedKey, Recipients: k.recipients,
		IV: b64(iv), Ciphertext: b64(ct), Tag: b64(tag),
	})
	if err != nil {
		return "", errcode.Wrap(errcode.Internal, err, "encoding a wrapped layer key")
	}
	return string(out), nil
}

// key returns the current CEK, making a new one when there is none or it
// has sealed maxSealsPerCEK messages.
func (s *sealer) key() (*sealKey, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cur == nil || s.cur.uses >= maxSealsPerCEK {
		k, err := newSealKey(s.recipients)
		if err != nil {
			return nil, err
		}
		s.cur = k
	}
	s.cur.uses++
	return s.cur, nil
}

func newSealKey(recipients []Recipient) (*sealKey, error) {
	cek := make([]byte, 32)
	defer clear(cek)
	if _, err := rand.Read(cek); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "generating a key-wrapping key")
	}
	block, err := aes.NewCipher(cek)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "key-wrapping cipher")
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "key-wrapping cipher")
	}
	k := &sealKey{aead: aead}
	protected := map[string]any{"enc": string(contentEncryption)}
	for _, r := range recipients {
		header, ek, err := wrapCEK(cek, r)
		if err != nil {
			return nil, err
		}
		k.recipients = append(k.recipients, jweRecipient{Header: header, EncryptedKey: base64.RawURLEncoding.EncodeToString(ek)})
	}
	if len(k.recipients) == 1 {
		// go-jose's form for one recipient: its header is protected.
		for h, v := range k.recipients[0].Header {
			protected[h] = v
		}
		k.encryptedKey, k.recipients = k.recipients[0].EncryptedKey, nil
	}
	p, err := json.Marshal(protected)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "encoding a JWE header")
	}
	k.protected = base64.RawURLEncoding.EncodeToString(p)
	return k, nil
}

// wrapCEK encrypts cek for r: RSA-OAEP for an RSA key, ECDH-ES+A256KW
// (an ephemeral key, Concat KDF, AES key wrap) for an EC key, as go-jose
// does. It returns the recipient's header and encrypted_key.
func wrapCEK(cek []byte, r Recipient) (map[string]any, []byte, error) {
	header := map[string]any{"kid": r.ID}
	switch pub := r.Key.(type) {
	case *rsa.PublicKey:
		header["alg"] = string(jose.RSA_OAEP)
		ek, err := rsa.EncryptOAEP(sha1.New(), rand.Reader, pub, cek, nil)
		if err != nil {
			return nil, nil, errcode.Wrap(errcode.Internal, err, "wrapping a key for %s", r.ID)
		}
		return header, ek, nil
	case *ecdsa.PublicKey:
		header["alg"] = string(jose.ECDH_ES_A256KW)
		eph, err := ecdsa.GenerateKey(pub.Curve, rand.Reader)
		if err != nil {
			return nil, nil, errcode.Wrap(errcode.Internal, err, "wrapping a key for %s", r.ID)
		}
		epk, err := jose.JSONWebKey{Key: &eph.PublicKey}.MarshalJSON()
		if err != nil {
			return nil, nil, errcode.Wrap(errcode.Internal, err, "wrapping a key for %s", r.ID)
		}
		header["epk"] = json.RawMessage(epk)
		kek, err := aes.NewCipher(josecipher.DeriveECDHES(string(jose.ECDH_ES_A256KW), nil, nil, eph, pub, 32))
		if err != nil {
			return nil, nil, errcode.Wrap(errcode.Internal, err, "wrapping a key for %s", r.ID)
		}
		ek, err := josecipher.KeyWrap(kek, cek)
		if err != nil {
			return nil, nil, errcode.Wrap(errcode.Internal, err, "wrapping a key for %s", r.ID)
		}
		return header, ek, nil
	}
	return nil, nil, errcode.New(errcode.Internal, "recipient %s: a %T cannot be a recipient", r.ID, r.Key)
}

// unwrapCache remembers the CEKs a restore's keys unwrapped, so that the
// layers of an image that share a wrapped CEK cost one private-key
// operation, not one each. An entry is keyed by everything the unwrap
// reads: the private key, the algorithm, the ephemeral public key and
// PartyU/PartyV info of ECDH-ES, and the encrypted_key. Unwrapping is a
// deterministic function of exactly these, so a cached answer is the one
// the private key would give again, success or failure. Whether the CEK
// opens a given JWE is still decided per layer, by its AES-GCM tag: a JWE
// that names another image's encrypted_key but was sealed under another
// CEK fails as it would without the cache.
type unwrapCache struct {
	mu sync.Mutex
	m  map[string]*unwrapped
	// budget is how many unwraps the cache may make (see baseUnwraps);
	// credited, the manifests whose layers were added to it.
	budget   int
	credited map[digest.Digest]bool
	// spent: an unwrap was refused, the budget made already.
	spent bool
}

// The private-key operations of one Decrypt repository (the unwraps the
// cache does not answer) are bounded: baseUnwraps, and unwrapsPerLayer for
// each encrypted layer of the manifests it read. An image vmsnap wrote
// needs one per CEK (65,536 layers each) for the key that opens it,
// another writer's one per layer; but a JWE may list any number of
// recipients, each an RSA operation of a millisecond or more that no
// deadline interrupts, so an image in a tenant's repository could
// otherwise keep the cores busy for minutes per manifest read.
const (
	baseUnwraps     = 1024
	unwrapsPerLayer = 2
)

// credit adds the budget of a manifest's encrypted layers, once per
// manifest.
func (c *unwrapCache) credit(manifest digest.Digest, layers int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.credited[manifest] {
		c.credited[manifest] = true
		c.budget += unwrapsPerLayer * layers
	}
}

// overBudget says whether an unwrap was refused for want of budget, and
// what the budget is.
func (c *unwrapCache) overBudget() (bool, int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.spent, c.budget
}

type unwrapped struct {
	once sync.Once
	cek  []byte
	err  error
}

func newUnwrapCache() *unwrapCache {
	return &unwrapCache{m: map[string]*unwrapped{}, budget: baseUnwraps, credited: map[digest.Digest]bool{}}
}

// cachedKey is a DecryptionKey as go-jose's decrypter of opaque keys: the
// unwrap of one JWE recipient, through the cache.
type cachedKey struct {
	key   DecryptionKey
	cache *unwrapCache
}

var _ jose.OpaqueKeyDecrypter = cachedKey{}

// errUnwrap is every unwrap failure: go-jose reports ErrCryptoFailure
// whatever it is, and so do we (no oracle for a key's padding).
var errUnwrap = errors.New("cannot unwrap the key")

func (c cachedKey) DecryptKey(encryptedKey []byte, header jose.Header) ([]byte, error) {
	alg := jose.KeyAlgorithm(header.Algorithm)
	var epk, apu, apv []byte
	if strings.HasPrefix(header.Algorithm, "ECDH-ES") {
		var err error
		if epk, err = json.Marshal(header.ExtraHeaders["epk"]); err != nil {
			return nil, errUnwrap
		}
		if apu, err = headerBytes(header, "apu"); err != nil {
			return nil, errUnwrap
		}
		if apv, err = headerBytes(header, "apv"); err != nil {
			return nil, errUnwrap
		}
	}
	// A recipient that names another key is not this key's to try.
	if kid := header.KeyID; strings.HasPrefix(kid, "sha256:") && kid != c.key.ID {
		return nil, errUnwrap
	}
	id := unwrapID(c.key.ID, alg, epk, apu, apv, encryptedKey)
	c.cache.mu.Lock()
	u := c.cache.m[id]
	if u == nil && len(c.cache.m) >= c.cache.budget {
		c.cache.spent = true
		c.cache.mu.Unlock()
		return nil, errUnwrap
	}
	if u == nil {
		u = &unwrapped{}
		c.cache.m[id] = u
	}
	c.cache.mu.Unlock()
	u.once.Do(func() { u.cek, u.err = unwrapCEK(c.key, alg, epk, apu, apv, encryptedKey) })
	if u.err != nil {
		return nil, u.err
	}
	// go-jose may keep or clear what it is given: a copy.
	return append([]byte(nil), u.cek...), nil
}

// unwrapID is the cache key: a hash of every input of the unwrap, each
// length-prefixed so that no two inputs run together.
func unwrapID(keyID string, alg jose.KeyAlgorithm, parts ...[]byte) string {
	h := sha256.New()
	write := func(b []byte) {
		var n [8]byte
		for i := range n {
			n[i] = byte(uint64(len(b)) >> (8 * i))
		}
		h.Write(n[:])
		h.Write(b)
	}
	write([]byte(keyID))
	write([]byte(alg))
	for _, p := range parts {
		write(p)
	}
	return string(h.Sum(nil))
}

// unwrapCEK is go-jose's unwrap for the algorithms vmsnap accepts
// (unwrapAlgorithms).
func unwrapCEK(k DecryptionKey, alg jose.KeyAlgorithm, epk, apu, apv, ek []byte) ([]byte, error) {
	switch priv := k.Key.(type) {
	case *rsa.PrivateKey:
		var h hash.Hash
		switch alg {
		case jose.RSA_OAEP:
			h = sha1.New()
		case jose.RSA_OAEP_256:
			h = sha256.New()
		default:
			return nil, errUnwrap
		}
		cek, err := rsa.DecryptOAEP(h, rand.Reader, priv, ek, nil)
		if err != nil {
			return nil, errUnwrap
		}
		return cek, nil
	case *ecdsa.PrivateKey:
		size := map[jose.KeyAlgorithm]int{jose.ECDH_ES_A128KW: 16, jose.ECDH_ES_A192KW: 24, jose.ECDH_ES_A256KW: 32}[alg]
		if size == 0 || len(ek) == 0 {
			return nil, errUnwrap
		}
		var jwk jose.JSONWebKey
		if err := jwk.UnmarshalJSON(epk); err != nil {
			return nil, errUnwrap
		}
		pub, ok := jwk.Key.(*ecdsa.PublicKey)
		if !ok || pub.Curve != priv.Curve || !onCurve(pub) {
			return nil, errUnwrap
		}
		kek, err := aes.NewCipher(josecipher.DeriveECDHES(string(alg), apu, apv, priv, pub, size))
		if err != nil {
			return nil, errUnwrap
		}
		cek, err := josecipher.KeyUnwrap(kek, ek)
		if err != nil {
			return nil, errUnwrap
		}
		return cek, nil
	}
	return nil, errUnwrap
}

// headerBytes decodes a base64url header parameter (apu, apv); absent is
// empty.
func headerBytes(h jose.Header, name jose.HeaderKey) ([]byte, error) {
	v, ok := h.ExtraHeaders[name]
	if !ok || v == nil {
		return nil, nil
	}
	s, ok := v.(string)
	if !ok {
		return nil, errUnwrap
	}
	return base64.RawURLEncoding.DecodeString(strings.TrimRight(s, "="))
}
