// Package pemkey reads the PEM key files of signing (package ociimage)
// and encryption (package imgcrypt): public and private RSA and EC keys,
// their type and strength, their KeyID, and the mode a secret key file
// must have. It parses bytes its callers read and opens no file; its
// errors must never quote those bytes.
package pemkey

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"os"
	"strings"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// ID names a public key without revealing anything secret: "sha256:"
// and the hex SHA-256 of its DER SubjectPublicKeyInfo, as
// `openssl pkey -pubin -in PUB.pem -outform DER | sha256sum` prints
// (imgcrypt.KeyID says where it is written).
func ID(pub crypto.PublicKey) (string, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(der)
	return "sha256:" + hex.EncodeToString(sum[:]), nil
}

// ParsePublic returns the first PEM public key in data ("PUBLIC KEY",
// "RSA PUBLIC KEY", or a "CERTIFICATE"'s), of a type CheckType accepts.
func ParsePublic(data []byte) (crypto.PublicKey, error) {
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
		return CheckType(pub)
	}
}

// CheckType accepts an RSA key of 2048 bits or more and an EC key.
func CheckType(k any) (crypto.PublicKey, error) {
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

// errNoPrivateKey is what a file without a usable private key says; never
// the file's bytes.
var errNoPrivateKey = errcode.New(errcode.Usage,
	"no PEM private key (\"PRIVATE KEY\", \"RSA PRIVATE KEY\" or \"EC PRIVATE KEY\", unencrypted) in it")

// ParsePrivate returns the first PEM private key in data (PKCS#8, PKCS#1
// or SEC 1, unencrypted), RSA or EC. Errors never quote data.
func ParsePrivate(data []byte) (crypto.PrivateKey, error) {
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

// keyModeRefused are the permission bits a secret file must not have:
// any for others, write for its group.
const keyModeRefused = 0o027

// CheckMode refuses (USAGE, naming what and path) a secret file of mode
// perm that others may read, or its group write.
func CheckMode(path, what string, perm os.FileMode) error {
	if perm&keyModeRefused != 0 {
		return errcode.New(errcode.Usage,
			"%s %s has mode %04o: others may read it or its group may change it; chmod 600 it (in Kubernetes, mount the Secret with defaultMode: 0400, or 0440 with the pod's fsGroup)", what, path, perm)
	}
	return nil
}
