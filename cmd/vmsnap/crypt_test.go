package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Key files are refused before anything starts when others may read them,
// and no error quotes them; flags take paths, never key bytes.
func TestKeyFlagsRefuseLooseKeys(t *testing.T) {
	dir := t.TempDir()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, _ := x509.MarshalPKCS8PrivateKey(k)
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})
	key := filepath.Join(dir, "key.pem")
	if err := os.WriteFile(key, pemBytes, 0o644); err != nil {
		t.Fatal(err)
	}
	secretLine := strings.Split(string(pemBytes), "\n")[1]
	pubDER, _ := x509.MarshalPKIXPublicKey(&k.PublicKey)
	pub := filepath.Join(dir, "pub.pem")
	if err := os.WriteFile(pub, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER}), 0o644); err != nil {
		t.Fatal(err)
	}
	pinned := "oci:" + dir + "/store@sha256:" + strings.Repeat("a", 64)
	for name, tc := range map[string]struct {
		args []string
		want string
	}{
		"restore":            {[]string{"restore", "--qmp", "/nonexistent.sock", "--image", pinned, "--decryption-key", key}, "chmod 600"},
		"checkpoint dedup":   {[]string{"checkpoint", "--qmp", "/nonexistent.sock", "--image", "oci:" + dir + "/s:t", "--encrypt-recipient", "jwe:" + pub, "--encrypt-dedup-key", key}, "chmod 600"},
		"recipient not jwe:": {[]string{"checkpoint", "--qmp", "/nonexistent.sock", "--image", "oci:" + dir + "/s:t", "--encrypt-recipient", pub}, "jwe:PATH"},
		"private as public":  {[]string{"checkpoint", "--qmp", "/nonexistent.sock", "--image", "oci:" + dir + "/s:t", "--encrypt-recipient", "jwe:" + key}, "no PEM public key"},
	} {
		t.Run(name, func(t *testing.T) {
			doc := cliError(t, errcode.Usage, tc.args...)
			if !strings.Contains(doc.Error.Message, tc.want) || strings.Contains(doc.Error.Message, secretLine) {
				t.Fatalf("error %q: want %q, and never the key", doc.Error.Message, tc.want)
			}
		})
	}
	// The agent refuses it before it starts (it has no --json).
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"agent", "--socket", filepath.Join(dir, "a.sock"), "--state-dir", dir, "--decryption-key-dir", dir}, &stdout, &stderr)
	if code != errcode.Usage.ExitStatus() || !strings.Contains(stderr.String(), "chmod 600") || strings.Contains(stderr.String()+stdout.String(), secretLine) {
		t.Fatalf("agent with a loose key: exit %d, %s", code, stderr.String())
	}
	// Through the agent, keys are the agent's.
	cliError(t, errcode.Usage, "restore", "--agent", "unix://"+dir+"/a.sock", "--pod-uid", "u", "--container", "c", "--qmp", "/q", "--image", pinned, "--decryption-key", key)
	cliError(t, errcode.Usage, "checkpoint", "--agent", "unix://"+dir+"/a.sock", "--pod-uid", "u", "--container", "c", "--qmp", "/q", "--image", "oci:/x:t", "--encrypt-recipient", "jwe:"+key)
}
