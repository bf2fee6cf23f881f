package ociimage

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"os"
	"slices"
	"strings"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Recipient is a public key a snapshot's layers are encrypted for.
type Recipient struct {
	Key crypto.PublicKey // *rsa.PublicKey or *ecdsa.PublicKey
	ID  string           // KeyID of Key
}

// DecryptionKey is a private key that may unwrap a layer's key.
type DecryptionKey struct {
	Key crypto.PrivateKey // *rsa.PrivateKey or *ecdsa.PrivateKey
	ID  string            // KeyID of its public key
	// Path is the file it was read from, for messages.
	Path string
}

// KeyID names a public key without revealing anything secret: "sha256:"
// and the hex SHA-256 of its DER SubjectPublicKeyInfo, as
// `openssl pkey -pubin -in PUB.pem -outform DER | sha256sum` prints. It is
// written into each wrapped key's JWE header ("kid"), so that a restore
// without the right key can say which keys the image was encrypted for.
func KeyID(pub crypto.PublicKey) (string, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(der)
	return "sha256:" + hex.EncodeToString(sum[:]), nil
}

// ParseRecipient reads a recipient given as "jwe:PATH" (the form of
// ocicrypt's tools): a PEM file of an RSA or EC public key, or of a
// certificate's.
func ParseRecipient(spec string) (Recipient, error) {
	path, ok := strings.CutPrefix(spec, "jwe:")
	if !ok || path == "" {
		return Recipient{}, errcode.New(errcode.Usage, "recipient %q: give jwe:PATH of a PEM public key (RSA or EC); other schemes (pgp, pkcs7, pkcs11, provider) are not supported", spec)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return Recipient{}, errcode.Wrap(errcode.Usage, err, "reading recipient key %s", path)
	}
	pub, err := parsePublicKey(data)
	if err != nil {
		return Recipient{}, errcode.Wrap(errcode.Usage, err, "recipient key %s", path)
	}
	id, err := KeyID(pub)
	if err != nil {
		return Recipient{}, errcode.Wrap(errcode.Usage, err, "recipient key %s", path)
	}
	return Recipient{Key: pub, ID: id}, nil
}

func parsePublicKey(data []byte) (crypto.PublicKey, error) {
	for rest := data; ; {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			return nil, errcode.New(errcode.Usage, "no PEM public key (\"PUBLIC KEY\" or \"CERTIFICATE\") in it; make one with openssl pkey -in PRIV.pem -pubout -out PUB.pem")
		}
		var pub any
		switch b.Type {
		case "PUBLIC KEY":
			k, err := x509.ParsePKIXPublicKey(b.Bytes)
			if err != nil {
				return nil, err
			}
			pub = k
		case "RSA PUBLIC KEY":
			k, err := x509.ParsePKCS1PublicKey(b.Bytes)
			if err != nil {
				return nil, err
			}
			pub = k
		case "CERTIFICATE":
			c, err := x509.ParseCertificate(b.Bytes)
			if err != nil {
				return nil, err
			}
			pub = c.PublicKey
		default:
			continue
		}
		return checkKeyType(pub)
	}
}

func checkKeyType(k any) (crypto.PublicKey, error) {
	switch k := k.(type) {
	case *rsa.PublicKey:
		if k.N.BitLen() < 2048 {
			return nil, errcode.New(errcode.Usage, "an RSA key of %d bits is too weak: use 2048 bits or more", k.N.BitLen())
		}
		return k, nil
	case *ecdsa.PublicKey:
		return k, nil
	}
	return nil, errcode.New(errcode.Usage, "a %T is not supported: use an RSA (2048 bits or more) or EC (P-256, P-384, P-521) key", k)
}

// LoadDecryptionKey reads a PEM private key (PKCS#8, PKCS#1 or SEC 1) from
// path. It refuses a file that others may read or write, or its group
// write (USAGE: chmod 600 it). Group read is allowed: it is how a
// Kubernetes Secret reaches a container that is not root (defaultMode 0440
// and the pod's fsGroup). Errors never quote the file's content.
func LoadDecryptionKey(path string) (DecryptionKey, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return DecryptionKey{}, errcode.Wrap(errcode.Usage, err, "decryption key %s", path)
	}
	if !fi.Mode().IsRegular() {
		return DecryptionKey{}, errcode.New(errcode.Usage, "decryption key %s is not a regular file", path)
	}
	if err := checkKeyMode(path, "decryption key", fi.Mode().Perm()); err != nil {
		return DecryptionKey{}, err
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return DecryptionKey{}, errcode.Wrap(errcode.Usage, err, "decryption key %s", path)
	}
	defer clear(data)
	return ParseDecryptionKey(data, path)
}

// ParseDecryptionKey reads a PEM private key from data, the content of the
// file name (for messages and DecryptionKey.Path): for a caller that opened
// and checked the file itself (CheckKeyMode). Errors never quote data.
func ParseDecryptionKey(data []byte, name string) (DecryptionKey, error) {
	priv, err := parsePrivateKey(data)
	if err != nil {
		return DecryptionKey{}, errcode.Wrap(errcode.Usage, err, "decryption key %s", name)
	}
	pub, err := checkKeyType(priv.(interface{ Public() crypto.PublicKey }).Public())
	if err != nil {
		return DecryptionKey{}, errcode.Wrap(errcode.Usage, err, "decryption key %s", name)
	}
	id, err := KeyID(pub)
	if err != nil {
		return DecryptionKey{}, errcode.Wrap(errcode.Usage, err, "decryption key %s", name)
	}
	return DecryptionKey{Key: priv, ID: id, Path: name}, nil
}

// Recipient is the public half of k: what to encrypt for so that k decrypts.
func (k DecryptionKey) Recipient() Recipient {
	return Recipient{Key: k.Key.(interface{ Public() crypto.PublicKey }).Public(), ID: k.ID}
}

// CheckKeyMode refuses (USAGE, naming path) a private key file of mode
// perm that others may read, or its group write: LoadDecryptionKey's
// check, for a caller that opened the file itself.
func CheckKeyMode(path string, perm os.FileMode) error {
	return checkKeyMode(path, "decryption key", perm)
}

// errNoPrivateKey is what a file without a usable private key says; never
// the file's bytes.
var errNoPrivateKey = errcode.New(errcode.Usage,
	"no PEM private key (\"PRIVATE KEY\", \"RSA PRIVATE KEY\" or \"EC PRIVATE KEY\", unencrypted) in it")

func parsePrivateKey(data []byte) (crypto.PrivateKey, error) {
	for rest := data; ; {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			return nil, errNoPrivateKey
		}
		var (
			k   any
			err error
		)
		switch b.Type {
		case "PRIVATE KEY":
			k, err = x509.ParsePKCS8PrivateKey(b.Bytes)
		case "RSA PRIVATE KEY":
			k, err = x509.ParsePKCS1PrivateKey(b.Bytes)
		case "EC PRIVATE KEY":
			k, err = x509.ParseECPrivateKey(b.Bytes)
		default:
			continue
		}
		clear(b.Bytes)
		if err != nil {
			// x509's message names the structure, not its content.
			return nil, errcode.Wrap(errcode.Usage, err, "cannot parse the %s", strings.ToLower(b.Type))
		}
		switch k.(type) {
		case *rsa.PrivateKey, *ecdsa.PrivateKey:
			return k, nil
		}
		return nil, errcode.New(errcode.Usage, "a %T is not supported: use an RSA or EC key", k)
	}
}

// LoadDedupSecret reads the secret of convergent encryption
// (EncryptOptions.DedupSecret): a file of at least 32 bytes (openssl rand
// -out FILE 32), guarded like a private key.
func LoadDedupSecret(path string) ([]byte, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "dedup key %s", path)
	}
	if err := checkKeyMode(path, "dedup key", fi.Mode().Perm()); err != nil {
		return nil, err
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "dedup key %s", path)
	}
	if len(b) < 32 {
		return nil, errcode.New(errcode.Usage, "dedup key %s has %d bytes; it needs 32 or more random bytes (openssl rand -out FILE 32)", path, len(b))
	}
	return b, nil
}

// keyModeRefused are the permission bits a secret file must not have:
// any for others, write for its group.
const keyModeRefused = 0o027

func checkKeyMode(path, what string, perm os.FileMode) error {
	if perm&keyModeRefused != 0 {
		return errcode.New(errcode.Usage,
			"%s %s has mode %04o: others may read it or its group may change it; chmod 600 it (in Kubernetes, mount the Secret with defaultMode: 0400, or 0440 with the pod's fsGroup)", what, path, perm)
	}
	return nil
}

// keyIDs lists the IDs of keys, sorted, for messages.
func keyIDs(keys []DecryptionKey) []string {
	var ids []string
	for _, k := range keys {
		ids = append(ids, k.ID)
	}
	slices.Sort(ids)
	return ids
}
