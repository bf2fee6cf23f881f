package e2e

// Signatures with the real cosign CLI (built from the module proxy into the
// test cache, internal/testing/tools) against Debian's docker-registry with TLS
// and htpasswd: cosign verifies what vmsnap signed, vmsnap verifies what
// cosign signed, and both refuse what was tampered with.

import (
	"context"
	"encoding/base64"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/internal/testing/tools"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// cosignCLI runs cosign against test registries: their CAs in
// SSL_CERT_FILE, their credentials in DOCKER_CONFIG, a home of its own,
// and no transparency log.
type cosignCLI struct {
	bin, home, caFile, dockerConfig string
}

func newCosign(t *testing.T, regs ...*registry.Registry) cosignCLI {
	t.Helper()
	c := cosignCLI{bin: tools.Cosign.Path(t), home: t.TempDir()}
	var cas []byte
	auths := map[string]string{}
	for _, r := range regs {
		b, err := os.ReadFile(r.CAFile)
		if err != nil {
			t.Fatal(err)
		}
		cas = append(cas, b...)
		auths[r.Host] = base64.StdEncoding.EncodeToString([]byte(r.User + ":" + r.Password))
	}
	c.caFile = filepath.Join(c.home, "ca.pem")
	c.dockerConfig = filepath.Join(c.home, "docker")
	if err := os.WriteFile(c.caFile, cas, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(c.dockerConfig, 0o700); err != nil {
		t.Fatal(err)
	}
	var entries []string
	for host, auth := range auths {
		entries = append(entries, `"`+host+`":{"auth":"`+auth+`"}`)
	}
	if err := os.WriteFile(filepath.Join(c.dockerConfig, "config.json"), []byte(`{"auths":{`+strings.Join(entries, ",")+`}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	return c
}

// run runs cosign args in dir with the password, and returns its output
// and error.
func (c cosignCLI) run(t *testing.T, dir, password string, args ...string) ([]byte, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.bin, args...)
	cmd.Dir = dir
	cmd.Env = []string{"HOME=" + c.home, "PATH=" + os.Getenv("PATH"), "SSL_CERT_FILE=" + c.caFile,
		"DOCKER_CONFIG=" + c.dockerConfig, "COSIGN_PASSWORD=" + password, "TUF_ROOT=" + filepath.Join(c.home, "tuf")}
	out, err := cmd.CombinedOutput()
	t.Logf("cosign %s -> %v\n%s", strings.Join(args, " "), err, out)
	return out, err
}

// keyPair makes a key pair with cosign generate-key-pair: cosign.key,
// encrypted with password, and cosign.pub.
func (c cosignCLI) keyPair(t *testing.T, password string) (key, pub string) {
	t.Helper()
	dir := t.TempDir()
	if _, err := c.run(t, dir, password, "generate-key-pair"); err != nil {
		t.Fatalf("cosign generate-key-pair: %v", err)
	}
	return filepath.Join(dir, "cosign.key"), filepath.Join(dir, "cosign.pub")
}

func (c cosignCLI) sign(t *testing.T, key, password, image string) {
	t.Helper()
	if _, err := c.run(t, t.TempDir(), password, "sign", "--key", key, "--tlog-upload=false", "--yes", image); err != nil {
		t.Fatalf("cosign sign %s: %v", image, err)
	}
}

// verify runs cosign verify --key pub on image and reports whether it
// accepted it.
func (c cosignCLI) verify(t *testing.T, pub, image string) bool {
	t.Helper()
	out, err := c.run(t, t.TempDir(), "", "verify", "--key", pub, "--insecure-ignore-tlog=true", image)
	if err == nil && !strings.Contains(string(out), `"docker-manifest-digest":"`+image[strings.LastIndex(image, "@")+1:]+`"`) {
		t.Fatalf("cosign verify %s passed without printing the payload of that digest:\n%s", image, out)
	}
	return err == nil
}

// passwordFile writes password to a file of mode 0600.
func passwordFile(t *testing.T, password string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "password")
	if err := os.WriteFile(p, []byte(password+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// Both ways on a real guest: a checkpoint cosign signed is refused until
// it is signed and then restores with vmsnap's verification; a checkpoint
// vmsnap signed passes cosign verify --key, and only with its key.
func TestSignE2ECosignInterop(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	reg := registry.Start(t)
	cos := newCosign(t, reg)
	const password = "signing key password"
	key, pub := cos.keyPair(t, password)
	_, otherPub := cos.keyPair(t, "other")
	dir := guest.FreeShortDir(t)
	src, before := bootSource(t, dir)
	overlay := filepath.Join(dir, "overlay.qcow2")

	// 1. cosign signs what vmsnap stored; vmsnap verifies.
	cp := cliJSON[api.CheckpointResult](t, with([]string{"checkpoint", "--qmp", src.QMPPath(), "--image", reg.Host + "/vms/signed:one",
		"--disk", overlay, "--disk-image", reg.Host + "/vms/signed/disk:one", "--mode", "snapshot"}, regArgs(reg)...)...)
	tdir := targetDir(t, dir)
	disk := filepath.Join(tdir, "overlay.qcow2")
	doc := cliError(t, errcode.AuthFailed, with([]string{"restore", "--disk-image", cp.Disk.Image, "--disk", disk, "--verify-key", pub}, regArgs(reg)...)...)
	if !strings.Contains(doc.Error.Message, "has no signature") {
		t.Fatalf("unsigned disk image: %s", doc.Error.Message)
	}
	if _, err := os.Lstat(disk); err == nil {
		t.Fatal("the unsigned disk image was restored")
	}
	cos.sign(t, key, password, cp.Disk.Image)
	cliJSON[api.RestoreResult](t, with([]string{"restore", "--disk-image", cp.Disk.Image, "--disk", disk, "--verify-key", pub}, regArgs(reg)...)...)
	target := startTarget(t, tdir, disk, 0)
	cliError(t, errcode.AuthFailed, with([]string{"restore", "--qmp", target.QMPPath(), "--image", cp.VMState.Image, "--verify-key", pub}, regArgs(reg)...)...)
	if st := runState(t, target); st != "inmigrate" {
		t.Fatalf("the target is %s after the unsigned state was refused, want inmigrate (nothing fed)", st)
	}
	cos.sign(t, key, password, cp.VMState.Image)
	cliError(t, errcode.AuthFailed, with([]string{"restore", "--qmp", target.QMPPath(), "--image", cp.VMState.Image, "--verify-key", otherPub}, regArgs(reg)...)...)
	cliJSON[api.RestoreResult](t, with([]string{"restore", "--qmp", target.QMPPath(), "--image", cp.VMState.Image,
		"--verify-key", otherPub, "--verify-key", pub}, regArgs(reg)...)...)
	now, _ := src.LastStatus()
	assertResumed(t, target, before, before.Counter+1, now.Counter+1)
	target.Kill()

	// 2. vmsnap signs (cosign's encrypted key, its password in a file);
	// cosign verifies, and refuses another key.
	cp2 := cliJSON[api.CheckpointResult](t, with([]string{"checkpoint", "--qmp", src.QMPPath(), "--image", reg.Host + "/vms/signed:two",
		"--disk", overlay, "--disk-image", reg.Host + "/vms/signed/disk:two", "--mode", "pause",
		"--sign-key", key, "--sign-key-password-file", passwordFile(t, password)}, regArgs(reg)...)...)
	src.Kill()
	for _, image := range []string{cp2.Checkpoint.Image, cp2.VMState.Image, cp2.Disk.Image} {
		if !cos.verify(t, pub, image) {
			t.Fatalf("cosign verify --key refuses %s, which vmsnap signed", image)
		}
		if cos.verify(t, otherPub, image) {
			t.Fatalf("cosign verify accepts %s with a key that did not sign it", image)
		}
	}
	staged := t.TempDir()
	cliJSON[api.RestoreResult](t, with([]string{"restore", "--image", cp2.Checkpoint.Image, "--to-dir", staged, "--verify-key", pub}, regArgs(reg)...)...)
}

// Attacks on signatures in a real registry, each refused by vmsnap
// (AUTH_FAILED, nothing staged) and, where cosign has a view, by cosign
// too: an unsigned image, one signed by another key, a tampered
// signature, another image's signature replayed under this one's tag,
// and a signature manifest larger than vmsnap reads. The images are
// checkpoints of a fake QEMU made with the CLI.
func TestSignE2ERefusals(t *testing.T) {
	t.Parallel()
	reg := registry.Start(t)
	cos := newCosign(t, reg)
	key, pub := cos.keyPair(t, "pw")
	otherKey, _ := cos.keyPair(t, "other")
	pw, otherPW := passwordFile(t, "pw"), passwordFile(t, "other")
	repoName := reg.Host + "/vms/attacks"
	checkpoint := func(tag string, sign ...string) string {
		vm := qmptest.NewFakeQEMU(t, "running", randomBytes(t, 64<<10))
		cp := cliJSON[api.CheckpointResult](t, with(append([]string{"checkpoint", "--qmp", vm.Path(), "--image", repoName + ":" + tag}, sign...), regArgs(reg)...)...)
		return cp.VMState.Image
	}
	signed := checkpoint("good", "--sign-key", key, "--sign-key-password-file", pw)
	staged := t.TempDir()
	cliJSON[api.RestoreResult](t, with([]string{"restore", "--image", signed, "--to-dir", staged, "--verify-key", pub}, regArgs(reg)...)...)
	if !cos.verify(t, pub, signed) {
		t.Fatal("cosign refuses the untampered image")
	}

	ref, err := ociimage.ParseReference(repoName)
	if err != nil {
		t.Fatal(err)
	}
	repo, err := ociimage.Open(context.Background(), ref, ociimage.WithRegistryConfig(reg.ConfigDir), ociimage.WithCAFile(reg.CAFile))
	if err != nil {
		t.Fatal(err)
	}
	attacks := []struct {
		name, image, says string
		cosignToo         bool
	}{
		{"unsigned", checkpoint("unsigned"), "has no signature", true},
		{"another key", checkpoint("other", "--sign-key", otherKey, "--sign-key-password-file", otherPW), "not made by any of the keys given", true},
		{"tampered signature", tamper(t, repo, checkpoint("tampered", "--sign-key", key, "--sign-key-password-file", pw)), "not made by any of the keys given", true},
		{"replayed signature", replay(t, repo, signed, checkpoint("replayed")), "it signs the manifest " + digestOf(signed), true},
		{"oversized signature manifest", oversize(t, repo, checkpoint("oversized", "--sign-key", key, "--sign-key-password-file", pw)), "more than the 524288 vmsnap reads", false},
	}
	for _, a := range attacks {
		t.Run(a.name, func(t *testing.T) {
			dir := t.TempDir()
			doc := cliError(t, errcode.AuthFailed, with([]string{"restore", "--image", a.image, "--to-dir", dir, "--verify-key", pub}, regArgs(reg)...)...)
			if !strings.Contains(doc.Error.Message, a.says) {
				t.Fatalf("the refusal does not say %q: %s", a.says, doc.Error.Message)
			}
			if entries, _ := os.ReadDir(dir); len(entries) != 0 {
				t.Fatalf("something was staged: %v", entries)
			}
			if a.cosignToo && cos.verify(t, pub, a.image) {
				t.Fatal("cosign verify accepts it")
			}
		})
	}
}

func digestOf(image string) string { return image[strings.LastIndex(image, "@")+1:] }

// signatureManifest reads the signature manifest of image from repo.
func signatureManifest(t *testing.T, repo ociimage.Repository, image string) (ocispec.Descriptor, ocispec.Manifest) {
	t.Helper()
	sd, err := repo.ResolveTag(context.Background(), ociimage.SignatureTag(digest.Digest(digestOf(image))))
	if err != nil {
		t.Fatal(err)
	}
	m, err := repo.Manifest(context.Background(), sd)
	if err != nil {
		t.Fatal(err)
	}
	return sd, m
}

// putSignatures stores m as image's signature manifest, as someone who may
// push would.
func putSignatures(t *testing.T, repo ociimage.Repository, image string, m ocispec.Manifest) {
	t.Helper()
	d, err := repo.PutManifest(context.Background(), m)
	if err != nil {
		t.Fatal(err)
	}
	if err := repo.TagManifest(context.Background(), d, ociimage.SignatureTag(digest.Digest(digestOf(image)))); err != nil {
		t.Fatal(err)
	}
}

// tamper flips a bit of image's signature.
func tamper(t *testing.T, repo ociimage.Repository, image string) string {
	t.Helper()
	_, m := signatureManifest(t, repo, image)
	sig, err := base64.StdEncoding.DecodeString(m.Layers[0].Annotations[ociimage.AnnotationCosignSignature])
	if err != nil {
		t.Fatal(err)
	}
	sig[len(sig)/2] ^= 1
	m.Layers[0].Annotations[ociimage.AnnotationCosignSignature] = base64.StdEncoding.EncodeToString(sig)
	putSignatures(t, repo, image, m)
	return image
}

// replay tags the signature manifest of signed as victim's.
func replay(t *testing.T, repo ociimage.Repository, signed, victim string) string {
	t.Helper()
	sd, _ := signatureManifest(t, repo, signed)
	if err := repo.TagManifest(context.Background(), sd, ociimage.SignatureTag(digest.Digest(digestOf(victim)))); err != nil {
		t.Fatal(err)
	}
	return victim
}

// oversize pads image's valid signature manifest past the bound with an
// annotation.
func oversize(t *testing.T, repo ociimage.Repository, image string) string {
	t.Helper()
	_, m := signatureManifest(t, repo, image)
	m.Annotations = map[string]string{"padding": strings.Repeat("x", ociimage.MaxSignatureManifestSize)}
	putSignatures(t, repo, image, m)
	return image
}

// cosign copy takes an image and its signature to another registry (with
// other credentials), where vmsnap verifies and restores it with the
// source registry stopped.
func TestSignE2ECosignCopy(t *testing.T) {
	t.Parallel()
	src, dst := registry.Start(t), registry.Start(t)
	cos := newCosign(t, src, dst)
	key, pub := cos.keyPair(t, "pw")
	vm := qmptest.NewFakeQEMU(t, "running", randomBytes(t, 64<<10))
	cp := cliJSON[api.CheckpointResult](t, with([]string{"checkpoint", "--qmp", vm.Path(), "--image", src.Host + "/vms/moved:v1",
		"--sign-key", key, "--sign-key-password-file", passwordFile(t, "pw")}, regArgs(src)...)...)
	if _, err := cos.run(t, t.TempDir(), "", "copy", cp.Checkpoint.Image, dst.Host+"/vms/moved"); err != nil {
		t.Fatalf("cosign copy: %v", err)
	}
	src.Stop()
	copied := dst.Host + "/vms/moved@" + cp.Checkpoint.Digest
	cliJSON[api.RestoreResult](t, with([]string{"restore", "--image", copied, "--to-dir", t.TempDir(), "--verify-key", pub}, regArgs(dst)...)...)
}
