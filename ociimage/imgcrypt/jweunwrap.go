package imgcrypt

// Unwrapping a layer key's JWE with a private key: go-jose's unwrap for the
// algorithms vmsnap reads, behind a cache of the CEKs unwrapped and a
// budget of private-key operations (see jwe.go for why).

import (
	"crypto/aes"
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
)

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
