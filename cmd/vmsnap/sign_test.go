package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/secure-systems-lab/go-securesystemslib/encrypted"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/keys"
	"github.com/vmsnap/vmsnap/ociimage"
)

// cosignKeyPair writes a key pair as cosign generate-key-pair does: the
// private key sealed with password (cosign.key, mode 0600) and the public
// key (cosign.pub).
func cosignKeyPair(t *testing.T, password string) (key, pub string) {
	t.Helper()
	dir := t.TempDir()
	_, pub, k := keys.ECPair(t, dir, "plain")
	key = filepath.Join(dir, "cosign.key")
	keys.Cosign(t, key, k, password, encrypted.Legacy)
	return key, pub
}

// The signing key's password comes from COSIGN_PASSWORD or a file, never a
// flag, and no error quotes it; a key that opens gets the checkpoint past
// its flags (to the missing VM).
func TestSignKeyPassword(t *testing.T) {
	const password = "correct horse battery"
	key, _ := cosignKeyPair(t, password)
	dir := t.TempDir()
	args := []string{"checkpoint", "--qmp", "/nonexistent.sock", "--image", "oci:" + dir + "/s:t", "--sign-key", key}

	t.Setenv(envCosignPassword, "")
	os.Unsetenv(envCosignPassword)
	doc := cliError(t, errcode.Usage, args...)
	if !strings.Contains(doc.Error.Message, "COSIGN_PASSWORD") {
		t.Fatalf("no password: %s", doc.Error.Message)
	}
	t.Setenv(envCosignPassword, "wrong "+password)
	doc = cliError(t, errcode.Usage, args...)
	if !strings.Contains(doc.Error.Message, "wrong password") || strings.Contains(doc.Error.Message, password) {
		t.Fatalf("wrong password: %s", doc.Error.Message)
	}
	t.Setenv(envCosignPassword, password)
	cliError(t, errcode.VMNotFound, args...)

	os.Unsetenv(envCosignPassword)
	pw := filepath.Join(dir, "password")
	if err := os.WriteFile(pw, []byte(password+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cliError(t, errcode.VMNotFound, append(args, "--sign-key-password-file", pw)...)
	if err := os.Chmod(pw, 0o644); err != nil {
		t.Fatal(err)
	}
	cliError(t, errcode.Usage, append(args, "--sign-key-password-file", pw)...)
	cliError(t, errcode.Usage, "checkpoint", "--qmp", "/nonexistent.sock", "--image", "oci:"+dir+"/s:t", "--sign-key-password-file", pw)
}

// Restore and prepare with --verify-key refuse an unsigned image with
// AUTH_FAILED before reading it; through the agent, keys are the agent's.
func TestVerifyKeyFlags(t *testing.T) {
	_, pub := cosignKeyPair(t, "p")
	dir := t.TempDir()
	repo, err := ociimage.Open(context.Background(), ociimage.Reference{Layout: dir})
	if err != nil {
		t.Fatal(err)
	}
	cfg := []byte(`{}`)
	cd := ocispec.Descriptor{MediaType: ociimage.MediaTypeVMStateConfig, Digest: digest.FromBytes(cfg), Size: int64(len(cfg))}
	if err := repo.PutBlob(context.Background(), cd, cfg); err != nil {
		t.Fatal(err)
	}
	desc, err := repo.PutManifest(context.Background(), ocispec.Manifest{ArtifactType: ociimage.ArtifactTypeVMState, Config: cd})
	if err != nil {
		t.Fatal(err)
	}
	image := "oci:" + dir + "@" + desc.Digest.String()
	staged := t.TempDir()
	doc := cliError(t, errcode.AuthFailed, "restore", "--image", image, "--to-dir", staged, "--verify-key", pub)
	if !strings.Contains(doc.Error.Message, "has no signature") || !strings.Contains(doc.Error.Message, pub) {
		t.Fatalf("restore of an unsigned image: %s", doc.Error.Message)
	}
	if entries, _ := os.ReadDir(staged); len(entries) != 0 {
		t.Fatalf("staged %v", entries)
	}
	cliError(t, errcode.AuthFailed, "prepare", image, "--cache-dir", filepath.Join(t.TempDir(), "ram"), "--verify-key", pub)
	cliError(t, errcode.Usage, "restore", "--image", image, "--to-dir", staged, "--verify-key", filepath.Join(dir, "missing.pub"))

	agentArgs := []string{"--agent", "unix://" + dir + "/a.sock"}
	cliError(t, errcode.Usage, append([]string{"restore", "--pod-uid", "u", "--container", "c", "--qmp", "/q", "--image", image, "--verify-key", pub}, agentArgs...)...)
	cliError(t, errcode.Usage, append([]string{"prepare", image, "--verify-key", pub}, agentArgs...)...)
	key, _ := cosignKeyPair(t, "p")
	cliError(t, errcode.Usage, append([]string{"checkpoint", "--pod-uid", "u", "--container", "c", "--qmp", "/q", "--image", "oci:/x:t", "--sign-key", key}, agentArgs...)...)
}
