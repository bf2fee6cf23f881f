package ociimage

import (
	"crypto"
	"crypto/x509"
	"encoding/pem"
	"io"
	"os"
	"strings"

	"github.com/secure-systems-lab/go-securesystemslib/encrypted"
	"github.com/sigstore/sigstore/pkg/signature"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/internal/pemkey"
)

// The PEM types of cosign's password-encrypted private keys (cosign
// generate-key-pair): the PKCS#8 key sealed with scrypt and
// nacl/secretbox (go-securesystemslib's "encrypted" format). Older cosign
// releases wrote the second.
const (
	pemSigstorePrivateKey = "ENCRYPTED SIGSTORE PRIVATE KEY"
	pemCosignPrivateKey   = "ENCRYPTED COSIGN PRIVATE KEY"
)

// maxKeyFile bounds what a key or password file may hold: a 4096-bit RSA
// key in PEM is about 3.3 KB.
const maxKeyFile = 64 << 10

// SignKey is a private key that signs manifests as cosign does.
type SignKey struct {
	signer signature.Signer
	ID     string // pemkey.ID of its public key
	Path   string // the file it was read from, for messages
}

// VerifyKey is a public key whose signatures a restore accepts.
type VerifyKey struct {
	verifier signature.Verifier
	ID       string // pemkey.ID of the key
	Path     string // the file it was read from, for messages
}

// LoadSignKey reads a private key from path: cosign's encrypted key
// (cosign generate-key-pair's cosign.key), opened with password, or a plain
// PEM private key (PKCS#8, SEC 1 or PKCS#1; RSA of 2048 bits or more, or
// ECDSA). Like a decryption key, the file must not be readable by others
// (USAGE: chmod 600 it). The key signs with sigstore's default algorithm
// for its type, as cosign sign does: ECDSA P-256 with SHA-256, which
// `cosign verify --key` checks without further flags. Errors never quote
// the file or the password.
func LoadSignKey(path string, password []byte) (SignKey, error) {
	data, err := ReadSecretFile(path, "signing key")
	if err != nil {
		return SignKey{}, err
	}
	defer clear(data)
	k, err := signKey(data, password)
	k.Path = path
	return k, errcode.Wrap(errcode.Usage, err, "signing key %s", path)
}

func signKey(data, password []byte) (SignKey, error) {
	priv, err := parseSignKey(data, password)
	if err != nil {
		return SignKey{}, err
	}
	cs, ok := priv.(crypto.Signer)
	if !ok {
		return SignKey{}, errcode.New(errcode.Usage, "a %T cannot sign", priv)
	}
	pub, err := pemkey.CheckType(cs.Public())
	if err != nil {
		return SignKey{}, err
	}
	signer, err := signature.LoadDefaultSigner(priv)
	if err != nil {
		return SignKey{}, err
	}
	id, err := pemkey.ID(pub)
	return SignKey{signer: signer, ID: id}, err
}

// parseSignKey decodes a cosign encrypted key with password, or else a
// plain PEM private key.
func parseSignKey(data, password []byte) (crypto.PrivateKey, error) {
	b, _ := pem.Decode(data)
	if b == nil || (b.Type != pemSigstorePrivateKey && b.Type != pemCosignPrivateKey) {
		return pemkey.ParsePrivate(data)
	}
	if password == nil {
		return nil, errcode.New(errcode.Usage,
			"it is encrypted (cosign generate-key-pair): give its password in the environment variable COSIGN_PASSWORD or in a file")
	}
	der, err := encrypted.Decrypt(b.Bytes, password)
	if err != nil {
		// secretbox says only that it could not open the box.
		return nil, errcode.New(errcode.Usage, "cannot decrypt it with the password given (wrong password, or not a cosign key)")
	}
	defer clear(der)
	k, err := x509.ParsePKCS8PrivateKey(der)
	if err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "cannot parse the decrypted key")
	}
	return k, nil
}

// LoadVerifyKey reads a PEM public key (cosign.pub, or openssl pkey
// -pubout's; RSA of 2048 bits or more, or ECDSA) whose signatures are
// accepted, checked with sigstore's default algorithm for its type as
// signing is.
func LoadVerifyKey(path string) (VerifyKey, error) {
	data, err := readPublicFile(path, "verification key")
	if err != nil {
		return VerifyKey{}, err
	}
	k, err := verifyKey(data)
	k.Path = path
	return k, errcode.Wrap(errcode.Usage, err, "verification key %s", path)
}

func verifyKey(data []byte) (VerifyKey, error) {
	pub, err := pemkey.ParsePublic(data)
	if err != nil {
		return VerifyKey{}, err
	}
	v, err := signature.LoadDefaultVerifier(pub)
	if err != nil {
		return VerifyKey{}, err
	}
	id, err := pemkey.ID(pub)
	return VerifyKey{verifier: v, ID: id}, err
}

// ReadSecretFile reads a small secret (a private key, a password) from
// path. The file is checked and read through one descriptor: it must be a
// regular file of at most 64 KiB that others may not read and its group
// may not write (USAGE: chmod 600 it; group read is how a Kubernetes
// Secret reaches a non-root container). Errors never quote it.
func ReadSecretFile(path, what string) ([]byte, error) {
	return readKeyFile(path, what, true)
}

// readPublicFile reads a small file that need not be secret (a public key).
func readPublicFile(path, what string) ([]byte, error) {
	return readKeyFile(path, what, false)
}

func readKeyFile(path, what string, secret bool) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "%s %s", what, path)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "%s %s", what, path)
	}
	if !fi.Mode().IsRegular() {
		return nil, errcode.New(errcode.Usage, "%s %s is not a regular file", what, path)
	}
	if secret {
		if err := pemkey.CheckMode(path, what, fi.Mode().Perm()); err != nil {
			return nil, err
		}
	}
	b, err := io.ReadAll(io.LimitReader(f, maxKeyFile+1))
	if err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "%s %s", what, path)
	}
	if len(b) > maxKeyFile {
		clear(b)
		return nil, errcode.New(errcode.Usage, "%s %s is larger than the %d KiB a key file may be", what, path, maxKeyFile>>10)
	}
	return b, nil
}

// ReadPasswordFile reads a password from path, guarded like a key
// (ReadSecretFile), without one trailing newline.
func ReadPasswordFile(path string) ([]byte, error) {
	b, err := ReadSecretFile(path, "password file")
	if err != nil {
		return nil, err
	}
	s := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
	clear(b)
	return []byte(s), nil
}
