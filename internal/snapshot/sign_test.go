package snapshot

import (
	"bytes"
	"context"
	"crypto/rand"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/keys"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// signingKeys makes an ECDSA P-256 key pair in files and loads it: the
// option that signs and the one that verifies.
func signingKeys(t *testing.T) (sign, verify ociimage.Option) {
	t.Helper()
	priv, pub, _ := keys.ECPair(t, t.TempDir(), "k")
	sk, err := ociimage.LoadSignKey(priv, nil)
	if err != nil {
		t.Fatal(err)
	}
	vk, err := ociimage.LoadVerifyKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	return ociimage.WithSigner(sk), ociimage.WithVerifyKeys(vk)
}

// checkpointFake checkpoints a fake VM (state and disk overlay) into the
// layout dir with opts and returns its images, the state it streamed
// and the directory of the overlay (with its backing file).
func checkpointFake(t *testing.T, dir, tag string, opts ...ociimage.Option) (img, diskImg, diskDir string, state []byte) {
	t.Helper()
	state = randomState(t, 256<<10)
	overlay := guest.NewDisk(t, t.TempDir())
	res, err := Checkpoint(context.Background(), CheckpointSpec{
		QMPPath: qmptest.NewFakeQEMU(t, "running", state).Path(), DiskPath: overlay,
		Image: "oci:" + dir + ":" + tag, DiskImage: "oci:" + dir + ":" + tag + "-disk", Store: opts,
	})
	if err != nil {
		t.Fatal(err)
	}
	return res.VMState.Image, res.Disk.Image, filepath.Dir(overlay), state
}

// With verification keys, every restore verifies its image's signature
// before anything else: an unsigned image reaches neither QEMU nor the
// disk nor the staging directory (AUTH_FAILED), a signed one restores.
func TestRestoresVerifySignaturesFirst(t *testing.T) {
	sign, verify := signingKeys(t)
	dir := t.TempDir()
	signed, signedDisk, diskDir, state := checkpointFake(t, dir, "signed", sign)
	unsigned, unsignedDisk, _, _ := checkpointFake(t, dir, "unsigned")
	ctx := context.Background()
	store := []ociimage.Option{verify}

	target := qmptest.NewFakeQEMU(t, "inmigrate", state)
	_, err := RestoreState(ctx, RestoreSpec{QMPPath: target.Path(), Image: unsigned, Store: store})
	wantAuthFailed(t, err)
	if got := received(target); len(got) != 0 || len(target.Commands()) != 0 {
		t.Fatalf("the refused image reached QEMU: %d bytes, commands %v", len(got), target.Commands())
	}
	if _, err := RestoreState(ctx, RestoreSpec{QMPPath: target.Path(), Image: signed, Store: store}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(received(target), state) {
		t.Fatal("the signed image's state was not loaded whole")
	}

	disk := filepath.Join(diskDir, "restored.qcow2")
	_, err = RestoreDisk(ctx, DiskRestoreSpec{Image: unsignedDisk, Path: disk, Store: store})
	wantAuthFailed(t, err)
	if _, err := os.Lstat(disk); err == nil {
		t.Fatal("the unsigned disk image was written")
	}
	if _, err := RestoreDisk(ctx, DiskRestoreSpec{Image: signedDisk, Path: disk, Store: store}); err != nil {
		t.Fatal(err)
	}

	staged := t.TempDir()
	_, err = Stage(ctx, StageSpec{Image: unsigned, Dir: staged, Store: store})
	wantAuthFailed(t, err)
	if entries, _ := os.ReadDir(staged); len(entries) != 0 {
		t.Fatalf("the unsigned image was staged: %v", entries)
	}
	if _, err := Stage(ctx, StageSpec{Image: signed, Dir: staged, Store: store}); err != nil {
		t.Fatal(err)
	}
}

func wantAuthFailed(t *testing.T, err error) {
	t.Helper()
	if errcode.Of(err) != errcode.AuthFailed {
		t.Fatalf("got %v (%s), want AUTH_FAILED", err, errcode.Of(err))
	}
}

// A memory-file image prepared on this node is restored from the device
// state kept beside its RAM file, without reading the store: its
// signature is read from the store all the same, so a prepare without
// keys does not let an unsigned image past a restore with them.
func TestRestoreFromNodeStillVerifies(t *testing.T) {
	_, verify := signingKeys(t)
	dir := t.TempDir()
	size := 4 << 20
	ram := make([]byte, size)
	rand.Read(ram[:size/4])
	ramPath := filepath.Join(t.TempDir(), "guest.ram")
	if err := os.WriteFile(ramPath, ram, 0o600); err != nil {
		t.Fatal(err)
	}
	qmptest.MapFile(t, ramPath)
	state := randomState(t, 32<<10)
	src := qmptest.NewFakeQEMU(t, "running", state)
	src.Memory = int64(size)
	src.RAMBackend = &qmptest.FakeBackend{ID: "ram0", Type: "memory-backend-file", MemPath: ramPath, Share: true}
	src.Caps["x-ignore-shared"] = false
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cp, err := Checkpoint(ctx, CheckpointSpec{QMPPath: src.Path(), Image: "oci:" + dir + ":vm", Mode: "snapshot"})
	if err != nil {
		t.Fatal(err)
	}
	cache := filepath.Join(t.TempDir(), "ram")
	prep, err := Prepare(ctx, PrepareSpec{Image: cp.VMState.Image, CacheDir: cache})
	if err != nil {
		t.Fatal(err)
	}
	target := func() *qmptest.FakeQEMU {
		vm := qmptest.NewFakeQEMU(t, "inmigrate", state)
		vm.Memory = int64(size)
		vm.RAMBackend = &qmptest.FakeBackend{ID: "ram0", Type: "memory-backend-file", MemPath: prep.MemoryFile}
		vm.Caps["x-ignore-shared"] = false
		return vm
	}
	// Without keys the restore takes the node's copy from its cache.
	res, err := RestoreState(ctx, RestoreSpec{QMPPath: target().Path(), Image: cp.VMState.Image, CacheDir: cache})
	if err != nil || !res.VMState.FromNode {
		t.Fatalf("restore without keys: %+v, %v; want it from the node", res, err)
	}
	vm := target()
	_, err = RestoreState(ctx, RestoreSpec{QMPPath: vm.Path(), Image: cp.VMState.Image, CacheDir: cache, Store: []ociimage.Option{verify}})
	wantAuthFailed(t, err)
	if len(received(vm)) != 0 {
		t.Fatal("the unsigned image's device state reached QEMU")
	}
	_, err = Prepare(ctx, PrepareSpec{Image: cp.VMState.Image, CacheDir: filepath.Join(t.TempDir(), "ram2"), Store: []ociimage.Option{verify}})
	wantAuthFailed(t, err)
}

// Prune deletes a removed checkpoint's signatures with it (the
// sha256-HEX.sig tags of its state and disk manifests), and the kept
// checkpoints still restore with their signatures verified.
func TestPruneDeletesSignatures(t *testing.T) {
	sign, verify := signingKeys(t)
	dir := t.TempDir()
	image := "oci:" + dir
	overlay, cps := fourCheckpoints(t, image, []ociimage.Option{sign})
	tags := func() []string {
		repo, err := ociimage.Open(context.Background(), ociimage.Reference{Layout: dir})
		if err != nil {
			t.Fatal(err)
		}
		list, err := repo.(ociimage.TagLister).ListTags(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, tg := range list {
			out = append(out, tg.Tag)
		}
		return out
	}
	sigTags := func(cp taken) []string {
		var out []string
		for _, d := range []string{cp.res.VMState.Digest, cp.res.Disk.Digest} {
			out = append(out, ociimage.SignatureTag(digest.Digest(d)))
		}
		return out
	}
	before := tags()
	for _, cp := range cps {
		for _, tg := range sigTags(cp) {
			if !slices.Contains(before, tg) {
				t.Fatalf("no signature tag %s before the prune: %v", tg, before)
			}
		}
	}
	res, err := Prune(context.Background(), PruneSpec{Repo: image, Keep: 2})
	if err != nil {
		t.Fatal(err)
	}
	after := tags()
	for _, cp := range cps[:2] {
		for _, tg := range sigTags(cp) {
			if slices.Contains(after, tg) || !slices.Contains(res.RemovedTags, tg) {
				t.Fatalf("signature tag %s of a removed checkpoint: tags %v, removed %v", tg, after, res.RemovedTags)
			}
		}
	}
	for _, cp := range cps[2:] {
		for _, tg := range sigTags(cp) {
			if !slices.Contains(after, tg) {
				t.Fatalf("signature tag %s of a kept checkpoint is gone: %v", tg, after)
			}
		}
		restoresExactly(t, overlay, cp, []ociimage.Option{verify})
	}
}
