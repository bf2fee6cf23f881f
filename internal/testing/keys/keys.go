// Package keys writes the key files of signing and encryption tests: key
// pairs in PEM, and a private key encrypted as cosign generate-key-pair
// writes it. It is for tests only; vmsnap reads keys with packages
// ociimage (signing) and ociimage/imgcrypt (encryption).
package keys

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"testing"

	"github.com/secure-systems-lab/go-securesystemslib/encrypted"
)

// ECPair writes an ECDSA P-256 key pair into dir: NAME.key (PKCS#8, mode
// 0600) and NAME.pub (PKIX). It returns their paths and the key.
func ECPair(t testing.TB, dir, name string) (priv, pub string, key *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	pubDER, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	priv, pub = filepath.Join(dir, name+".key"), filepath.Join(dir, name+".pub")
	write(t, priv, &pem.Block{Type: "PRIVATE KEY", Bytes: der})
	write(t, pub, &pem.Block{Type: "PUBLIC KEY", Bytes: pubDER})
	return priv, pub, key
}

// Cosign writes key at path (mode 0600) as cosign generate-key-pair does:
// its PKCS#8 DER sealed with password (scrypt and NaCl secretbox, at the
// given scrypt strength: cosign writes Standard, which takes about 100 ms
// to open; Legacy keeps tests fast, and cosign reads both) in an
// "ENCRYPTED SIGSTORE PRIVATE KEY" PEM block.
func Cosign(t testing.TB, path string, key crypto.PrivateKey, password string, strength encrypted.KDFParameterStrength) {
	t.Helper()
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	sealed, err := encrypted.EncryptWithCustomKDFParameters(der, []byte(password), strength)
	if err != nil {
		t.Fatal(err)
	}
	write(t, path, &pem.Block{Type: "ENCRYPTED SIGSTORE PRIVATE KEY", Bytes: sealed})
}

func write(t testing.TB, path string, b *pem.Block) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(b), 0o600); err != nil {
		t.Fatal(err)
	}
}

// PEMPair writes a key pair into dir: NAME.key (PKCS#8, mode 0600) and
// NAME.pub.pem (PKIX, mode 0644), of an ECDSA P-256 key if ec, else of an
// RSA-2048 one. It returns their paths.
func PEMPair(t testing.TB, dir, name string, ec bool) (priv, pub string) {
	t.Helper()
	var k crypto.Signer
	var err error
	if ec {
		k, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	} else {
		k, err = rsa.GenerateKey(rand.Reader, 2048)
	}
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	pubDER, err := x509.MarshalPKIXPublicKey(k.Public())
	if err != nil {
		t.Fatal(err)
	}
	priv, pub = filepath.Join(dir, name+".key"), filepath.Join(dir, name+".pub.pem")
	write(t, priv, &pem.Block{Type: "PRIVATE KEY", Bytes: der})
	if err := os.WriteFile(pub, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER}), 0o644); err != nil {
		t.Fatal(err)
	}
	return priv, pub
}
