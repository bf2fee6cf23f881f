package e2e

// Encryption at rest end to end: a real guest checkpointed encrypted into
// the TLS + htpasswd test registry, decrypted by skopeo (an independent
// client of the OCI image encryption convention), restored with the right
// key, refused without it.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/keys"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
)

// e2eKey writes a key pair as PEM files (keys.PEMPair) and returns the
// paths and the public key's KeyID.
func e2eKey(t testing.TB, dir, name string, ec bool) (priv, pub, id string) {
	t.Helper()
	priv, pub = keys.PEMPair(t, dir, name, ec)
	raw, err := os.ReadFile(pub)
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(raw)
	if block == nil {
		t.Fatalf("%s holds no PEM block", pub)
	}
	sum := sha256.Sum256(block.Bytes)
	return priv, pub, "sha256:" + hex.EncodeToString(sum[:])
}

// keyLines are the base64 lines of the private key files: none may appear
// in any output.
func keyLines(t testing.TB, paths ...string) []string {
	var out []string
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(b), "\n") {
			if len(l) > 20 && !strings.HasPrefix(l, "-----") {
				out = append(out, l)
			}
		}
	}
	return out
}

// cliNoKeys runs vmsnap, fails if stdout or stderr holds a line of a
// private key, and returns stdout and the exit status.
func cliNoKeys(t testing.TB, secret []string, args ...string) ([]byte, int) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := runBinary(t, args, &stdout, &stderr)
	t.Logf("vmsnap %s -> exit %d\n%s%s", strings.Join(args, " "), code, stderr.String(), stdout.String())
	for _, l := range secret {
		if strings.Contains(stdout.String()+stderr.String(), l) {
			t.Fatalf("vmsnap %s printed private key material", args[0])
		}
	}
	return stdout.Bytes(), code
}

func cliNoKeysJSON[T any](t testing.TB, secret []string, args ...string) T {
	t.Helper()
	out, code := cliNoKeys(t, secret, append(args, "--json")...)
	if code != 0 {
		t.Fatalf("vmsnap %s failed with exit %d: %s", args[0], code, out)
	}
	var v T
	if err := json.Unmarshal(out, &v); err != nil {
		t.Fatalf("vmsnap %s: %v\n%s", args[0], err, out)
	}
	return v
}

func cliNoKeysError(t testing.TB, secret []string, code errcode.Code, args ...string) api.ErrorDoc {
	t.Helper()
	out, exit := cliNoKeys(t, secret, append(args, "--json")...)
	var doc api.ErrorDoc
	if err := json.Unmarshal(out, &doc); err != nil {
		t.Fatalf("no JSON error object on stdout: %v\n%s", err, out)
	}
	if doc.Error.Code != code || exit != code.ExitStatus() {
		t.Fatalf("got %s (exit %d), want %s (exit %d): %s", doc.Error.Code, exit, code, code.ExitStatus(), doc.Error.Message)
	}
	return doc
}

func TestEncryptE2ERegistry(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	if _, err := os.Stat("/usr/bin/skopeo"); err != nil {
		guest.SkipOrFail(t, "skopeo", "skopeo not installed (make deps)")
	}
	reg := registry.Start(t)
	keys := t.TempDir()
	priv, pub, id := e2eKey(t, keys, "tenant", false)
	other, _, otherID := e2eKey(t, keys, "other", true)
	secret := keyLines(t, priv, other)

	dir := guest.FreeShortDir(t)
	src, before := bootSource(t, dir)
	termLog := filepath.Join(t.TempDir(), "termination-log")
	cp := cliNoKeysJSON[api.CheckpointResult](t, secret, with([]string{"checkpoint", "--qmp", src.QMPPath(),
		"--image", reg.Host + "/vms/enc:vm1", "--disk", filepath.Join(dir, "overlay.qcow2"), "--disk-image", reg.Host + "/vms/enc:vm1-disk",
		"--mode", "pause", "--encrypt-recipient", "jwe:" + pub, "--termination-log", termLog}, regArgs(reg)...)...)
	resume := src.ResumeCounter()
	src.Kill()
	if b, err := os.ReadFile(termLog); err != nil || len(b) == 0 {
		t.Fatalf("termination log: %v", err)
	} else {
		for _, l := range secret {
			if strings.Contains(string(b), l) {
				t.Fatal("the termination log holds private key material")
			}
		}
	}

	// In the registry, every layer of both images is encrypted for the key.
	stateM := manifestFromRegistry(t, reg, cp.VMState.Image)
	for _, m := range []ocispec.Manifest{stateM, manifestFromRegistry(t, reg, cp.Disk.Image)} {
		if len(m.Layers) == 0 {
			t.Fatal("an image without layers")
		}
		for i, l := range m.Layers {
			if l.MediaType != ociimage.MediaTypeChunk+"+encrypted" || strings.Join(imgcrypt.EncryptedFor(l), ",") != id {
				t.Fatalf("layer %d: %s, encrypted for %v, want %s+encrypted for %s", i, l.MediaType, imgcrypt.EncryptedFor(l), ociimage.MediaTypeChunk, id)
			}
		}
	}

	// skopeo decrypts what vmsnap encrypted: each layer back to the
	// plaintext blob vmsnap's own reader finds, by digest.
	plainM := decryptedManifest(t, reg, cp.VMState.Image, priv)
	out := filepath.Join(t.TempDir(), "skopeo")
	if _, err := registry.Skopeo(t, waitCtx(t), "copy", "--quiet", "--src-cert-dir", reg.CertDir, "--src-authfile", reg.AuthFile,
		"--decryption-key", priv, "docker://"+cp.VMState.Image, "oci:"+out); err != nil {
		t.Fatal(err)
	}
	skopeoM := layoutManifest(t, out)
	if len(skopeoM.Layers) != len(plainM.Layers) {
		t.Fatalf("skopeo wrote %d layers, the image has %d", len(skopeoM.Layers), len(plainM.Layers))
	}
	for i, l := range skopeoM.Layers {
		if l.MediaType != ociimage.MediaTypeChunk || l.Digest != plainM.Layers[i].Digest {
			t.Fatalf("skopeo's layer %d is %s %s, want %s %s", i, l.MediaType, l.Digest, ociimage.MediaTypeChunk, plainM.Layers[i].Digest)
		}
		b, err := os.ReadFile(filepath.Join(out, "blobs", "sha256", l.Digest.Encoded()))
		if err != nil {
			t.Fatal(err)
		}
		if sum := sha256.Sum256(b); hex.EncodeToString(sum[:]) != l.Digest.Encoded() {
			t.Fatalf("skopeo's layer %d does not hash to its digest", i)
		}
	}
	// And skopeo without a key cannot.
	if _, err := registry.Skopeo(t, waitCtx(t), "copy", "--quiet", "--src-cert-dir", reg.CertDir, "--src-authfile", reg.AuthFile,
		"--decryption-key", other, "docker://"+cp.VMState.Image, "oci:"+filepath.Join(t.TempDir(), "no")); err == nil {
		t.Fatal("skopeo decrypted the image with a key that is not a recipient")
	}

	tdir := targetDir(t, dir)
	disk := filepath.Join(tdir, "overlay.qcow2")
	// The disk overlay needs the key too.
	doc := cliNoKeysError(t, secret, errcode.AuthFailed, with([]string{"restore", "--disk-image", cp.Disk.Image, "--disk", disk}, regArgs(reg)...)...)
	if !strings.Contains(doc.Error.Message, id) || !strings.Contains(doc.Error.Message, "--decryption-key") {
		t.Fatalf("missing key: %s", doc.Error.Message)
	}
	if _, err := os.Stat(disk); err == nil {
		t.Fatal("a refused disk restore left an overlay")
	}
	cliNoKeysJSON[api.RestoreResult](t, secret, with([]string{"restore", "--disk-image", cp.Disk.Image, "--disk", disk, "--decryption-key", priv}, regArgs(reg)...)...)
	target := startTarget(t, tdir, disk, 0)
	state := with([]string{"restore", "--qmp", target.QMPPath(), "--image", cp.VMState.Image}, regArgs(reg)...)

	// Missing key, wrong key, a key file others may read: refused, QEMU untouched.
	doc = cliNoKeysError(t, secret, errcode.AuthFailed, state...)
	if !strings.Contains(doc.Error.Message, id) {
		t.Fatalf("missing key: %s does not name the recipient %s", doc.Error.Message, id)
	}
	doc = cliNoKeysError(t, secret, errcode.AuthFailed, with(state, "--decryption-key", other)...)
	if !strings.Contains(doc.Error.Message, id) || !strings.Contains(doc.Error.Message, otherID) {
		t.Fatalf("wrong key: %s should name the recipient %s and the key given %s", doc.Error.Message, id, otherID)
	}
	loose := filepath.Join(keys, "loose.key")
	copyFile(t, priv, loose)
	if err := os.Chmod(loose, 0o644); err != nil {
		t.Fatal(err)
	}
	doc = cliNoKeysError(t, secret, errcode.Usage, with(state, "--decryption-key", loose)...)
	if !strings.Contains(doc.Error.Message, "chmod 600") {
		t.Fatalf("a key file others may read: %s", doc.Error.Message)
	}
	if st := runState(t, target); st != "inmigrate" {
		t.Fatalf("target is %s after refused restores, want inmigrate (untouched)", st)
	}

	// The right key (beside a wrong one) restores the guest exactly.
	rs := cliNoKeysJSON[api.RestoreResult](t, secret, with(state, "--decryption-key", other, "--decryption-key", priv)...)
	if rs.VMState == nil || !rs.VMState.VMRunning || rs.VMState.RawBytes != cp.VMState.RawBytes {
		t.Fatalf("state restore: %+v", rs)
	}
	assertResumed(t, target, before, resume, resume)

	// A tampered ciphertext: a copy of the image (as stored, encrypted) in
	// a layout with one byte of its first layer flipped is refused before
	// QEMU sees a byte.
	lay := filepath.Join(t.TempDir(), "copy")
	copied := copyRaw(t, reg, cp.VMState.Image, lay)
	flipByte(t, filepath.Join(lay, "blobs", "sha256", stateM.Layers[0].Digest.Encoded()))
	tdir2 := targetDir(t, dir)
	disk2 := filepath.Join(tdir2, "overlay.qcow2")
	cliNoKeysJSON[api.RestoreResult](t, secret, with([]string{"restore", "--disk-image", cp.Disk.Image, "--disk", disk2, "--decryption-key", priv}, regArgs(reg)...)...)
	target2 := startTarget(t, tdir2, disk2, 0)
	cliNoKeysError(t, secret, errcode.DigestMismatch, "restore", "--qmp", target2.QMPPath(), "--image", "oci:"+lay+"@"+copied, "--decryption-key", priv)
	if st := runState(t, target2); st != "inmigrate" {
		t.Fatalf("target is %s after a tampered image, want inmigrate (untouched)", st)
	}
}

// decryptedManifest is an image's manifest as vmsnap reads it with key.
func decryptedManifest(t *testing.T, reg *registry.Registry, image, key string) ocispec.Manifest {
	t.Helper()
	k, err := imgcrypt.LoadDecryptionKey(key)
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := ociimage.ParseReference(image)
	repo, err := ociimage.Open(context.Background(), ref, ociimage.WithCAFile(reg.CAFile), ociimage.WithRegistryConfig(reg.ConfigDir), imgcrypt.WithDecryptionKeys(k))
	if err != nil {
		t.Fatal(err)
	}
	desc, err := repo.Resolve(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	m, err := repo.Manifest(context.Background(), desc)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// copyRaw copies an image as stored (encrypted) into a layout and returns
// its manifest digest there.
func copyRaw(t *testing.T, reg *registry.Registry, image, dir string) string {
	t.Helper()
	ref, _ := ociimage.ParseReference(image)
	src, err := ociimage.Open(context.Background(), ref, ociimage.WithCAFile(reg.CAFile), ociimage.WithRegistryConfig(reg.ConfigDir))
	if err != nil {
		t.Fatal(err)
	}
	dst, _ := ociimage.Open(context.Background(), ociimage.Reference{Layout: dir})
	d, err := ociimage.Copy(context.Background(), src, dst, 0, 4)
	if err != nil {
		t.Fatal(err)
	}
	return d.Digest.String()
}

// layoutManifest reads the one manifest of an OCI layout skopeo wrote.
func layoutManifest(t *testing.T, dir string) ocispec.Manifest {
	t.Helper()
	var idx ocispec.Index
	b, err := os.ReadFile(filepath.Join(dir, "index.json"))
	if err == nil {
		err = json.Unmarshal(b, &idx)
	}
	if err != nil || len(idx.Manifests) != 1 {
		t.Fatalf("index.json of %s: %v (%d manifests)", dir, err, len(idx.Manifests))
	}
	var m ocispec.Manifest
	b, err = os.ReadFile(filepath.Join(dir, "blobs", "sha256", idx.Manifests[0].Digest.Encoded()))
	if err == nil {
		err = json.Unmarshal(b, &m)
	}
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// Incremental checkpoints encrypted, through the registry: an unchanged
// VM checkpointed twice uploads everything again with random layer keys,
// and almost nothing with --encrypt-dedup-key (the documented trade-off:
// equal chunks are equal blobs). Each checkpoint is of a paused copy of
// one plain checkpoint of the source (pausedCopy): the guest never runs
// between two, so their memory is the same, byte for byte.
func TestEncryptE2ERepeatCheckpoint(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	reg := registry.Start(t)
	keys := t.TempDir()
	priv, pub, _ := e2eKey(t, keys, "tenant", true)
	dedup := filepath.Join(keys, "dedup")
	if err := os.WriteFile(dedup, bytes.Repeat([]byte{0x42}, 32), 0o600); err != nil {
		t.Fatal(err)
	}
	secret := append(keyLines(t, priv), strings.Repeat("B", 32))
	dir := guest.FreeShortDir(t)
	src, _ := bootSource(t, dir)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := src.QMP(ctx, "stop", nil); err != nil {
		t.Fatal(err)
	}
	base := cliJSON[api.CheckpointResult](t, with([]string{"checkpoint", "--qmp", src.QMPPath(),
		"--image", reg.Host + "/vms/base:plain", "--mode", "snapshot"}, regArgs(reg)...)...).VMState.Image
	src.Kill() // its disk goes to the copies
	copyOpts := guest.Options{Disk: filepath.Join(dir, "overlay.qcow2"), Dir: dir}
	checkpoint := func(repo string, extra ...string) api.CheckpointResult {
		vm := pausedCopy(t, reg, copyOpts, base)
		defer vm.Kill() // the next copy takes the disk
		return cliNoKeysJSON[api.CheckpointResult](t, secret, with(with([]string{"checkpoint", "--qmp", vm.QMPPath(),
			"--image", reg.Host + "/vms/" + repo, "--mode", "snapshot", "--encrypt-recipient", "jwe:" + pub}, extra...), regArgs(reg)...)...)
	}
	for _, tc := range []struct {
		name  string
		extra []string
		ok    func(second, first int64) bool
	}{
		{"random keys", nil, func(s, f int64) bool { return s*10 >= f*9 }},
		// Only the device state at the stream's end differs (the copies'
		// devices went through a load): one chunk of ten, where random
		// keys re-upload nine tenths or more.
		{"dedup key", []string{"--encrypt-dedup-key", dedup}, func(s, f int64) bool { return s*5 < f }},
	} {
		repo := strings.ReplaceAll(tc.name, " ", "-")
		a := checkpoint(repo+":first", tc.extra...).VMState
		b := checkpoint(repo+":second", tc.extra...).VMState
		t.Logf("%s: first checkpoint uploaded %d of %d bytes, second %d of %d", tc.name, a.UploadedBytes, a.StoredBytes, b.UploadedBytes, b.StoredBytes)
		if a.UploadedBytes < a.StoredBytes/2 || !tc.ok(b.UploadedBytes, a.UploadedBytes) {
			t.Fatalf("%s: the second checkpoint of an unchanged VM uploaded %d bytes, the first %d", tc.name, b.UploadedBytes, a.UploadedBytes)
		}
		for _, l := range manifestFromRegistry(t, reg, b.Image).Layers {
			if !imgcrypt.IsEncrypted(l) {
				t.Fatalf("%s: a layer in the clear: %+v", tc.name, l)
			}
		}
	}
}
