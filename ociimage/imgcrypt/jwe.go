package imgcrypt

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha1"
	"encoding/base64"
	"encoding/json"
	"sync"

	"github.com/go-jose/go-jose/v4"
	josecipher "github.com/go-jose/go-jose/v4/cipher"

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
