package ociimage

import (
	"bytes"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/secure-systems-lab/go-securesystemslib/encrypted"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/keys"
	"github.com/vmsnap/vmsnap/ociimage/internal/pemkey"
)

func TestLoadSignKeyCosignEncrypted(t *testing.T) {
	dir := t.TempDir()
	_, pubPath, k := keys.ECPair(t, dir, "plain")
	path := filepath.Join(dir, "cosign.key")
	keys.Cosign(t, path, k, "s3cret-pass", encrypted.Legacy)

	_, err := LoadSignKey(path, nil)
	wantCode(t, err, errcode.Usage, "COSIGN_PASSWORD")
	_, err = LoadSignKey(path, []byte("wrong-pass"))
	wantCode(t, err, errcode.Usage, "wrong password")
	if strings.Contains(err.Error(), "wrong-pass") {
		t.Fatalf("the error quotes the password: %v", err)
	}
	sk, err := LoadSignKey(path, []byte("s3cret-pass"))
	if err != nil {
		t.Fatal(err)
	}
	want, _ := pemkey.ID(&k.PublicKey)
	if sk.ID != want {
		t.Fatalf("key ID %s, want %s", sk.ID, want)
	}

	// What it signs, the public key verifies.
	repo := openLayoutWith(t, "oci:"+t.TempDir(), WithSigner(sk))
	desc := pushSigned(t, repo, "cosign key")
	vk, err := LoadVerifyKey(pubPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := VerifySignature(t.Context(), repo, desc, []VerifyKey{vk}); err != nil {
		t.Fatal(err)
	}
}

// Plain PEM keys sign too (EC and RSA), and both verify their own
// signatures; a weak RSA key is refused.
func TestLoadSignKeyPlain(t *testing.T) {
	dir := t.TempDir()
	for _, ec := range []bool{true, false} {
		priv, pub := keys.PEMPair(t, dir, map[bool]string{true: "ec", false: "rsa"}[ec], ec)
		sk, err := LoadSignKey(priv, []byte("ignored for a plain key"))
		if err != nil {
			t.Fatal(err)
		}
		vk, err := LoadVerifyKey(pub)
		if err != nil {
			t.Fatal(err)
		}
		repo := openLayoutWith(t, "oci:"+t.TempDir(), WithSigner(sk))
		if err := VerifySignature(t.Context(), repo, pushSigned(t, repo, "plain"), []VerifyKey{vk}); err != nil {
			t.Fatalf("ec=%v: %v", ec, err)
		}
	}
	weak, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	der, _ := x509.MarshalPKCS8PrivateKey(weak)
	path := filepath.Join(dir, "weak.key")
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = LoadSignKey(path, nil)
	wantCode(t, err, errcode.Usage, "too weak")
}

// A private key or password file others may read is refused, as is a
// directory or an oversized file; errors never quote the file.
func TestSignKeyFileGuards(t *testing.T) {
	dir := t.TempDir()
	priv, _ := keys.PEMPair(t, dir, "k", true)
	if err := os.Chmod(priv, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := LoadSignKey(priv, nil)
	wantCode(t, err, errcode.Usage, "chmod 600")
	_, err = LoadSignKey(dir, nil)
	wantCode(t, err, errcode.Usage, "not a regular file")

	big := filepath.Join(dir, "big")
	if err := os.WriteFile(big, bytes.Repeat([]byte("A"), maxKeyFile+1), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = LoadSignKey(big, nil)
	wantCode(t, err, errcode.Usage, "larger than")
	if strings.Contains(err.Error(), "AAAA") {
		t.Fatalf("the error quotes the file: %v", err)
	}

	pw := filepath.Join(dir, "password")
	if err := os.WriteFile(pw, []byte("pass word\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if b, err := ReadPasswordFile(pw); err != nil || string(b) != "pass word" {
		t.Fatalf("password %q, %v", b, err)
	}
	if err := os.Chmod(pw, 0o604); err != nil {
		t.Fatal(err)
	}
	_, err = ReadPasswordFile(pw)
	wantCode(t, err, errcode.Usage, "chmod 600")
}

func TestLoadVerifyKeyRefusesNonKeys(t *testing.T) {
	dir := t.TempDir()
	priv, _ := keys.PEMPair(t, dir, "k", true)
	_, err := LoadVerifyKey(priv)
	wantCode(t, err, errcode.Usage, "no PEM public key")
	_, err = LoadVerifyKey(filepath.Join(dir, "missing.pub"))
	wantCode(t, err, errcode.Usage, "missing.pub")
}
