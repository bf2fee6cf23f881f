package imgcrypt

import (
	"crypto"
	"os"
	"slices"
	"strings"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/internal/pemkey"
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
	return pemkey.ID(pub)
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
	pub, err := pemkey.ParsePublic(data)
	if err != nil {
		return Recipient{}, errcode.Wrap(errcode.Usage, err, "recipient key %s", path)
	}
	id, err := KeyID(pub)
	if err != nil {
		return Recipient{}, errcode.Wrap(errcode.Usage, err, "recipient key %s", path)
	}
	return Recipient{Key: pub, ID: id}, nil
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
	if err := pemkey.CheckMode(path, "decryption key", fi.Mode().Perm()); err != nil {
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
	priv, err := pemkey.ParsePrivate(data)
	if err != nil {
		return DecryptionKey{}, errcode.Wrap(errcode.Usage, err, "decryption key %s", name)
	}
	pub, err := pemkey.CheckType(priv.(interface{ Public() crypto.PublicKey }).Public())
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
	return pemkey.CheckMode(path, "decryption key", perm)
}

// LoadDedupSecret reads the secret of convergent encryption
// (EncryptOptions.DedupSecret): a file of at least 32 bytes (openssl rand
// -out FILE 32), guarded like a private key.
func LoadDedupSecret(path string) ([]byte, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "dedup key %s", path)
	}
	if err := pemkey.CheckMode(path, "dedup key", fi.Mode().Perm()); err != nil {
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

// keyIDs lists the IDs of keys, sorted, for messages.
func keyIDs(keys []DecryptionKey) []string {
	var ids []string
	for _, k := range keys {
		ids = append(ids, k.ID)
	}
	slices.Sort(ids)
	return ids
}
