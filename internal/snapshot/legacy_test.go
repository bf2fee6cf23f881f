package snapshot

import (
	"context"
	"net"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/testing/prunetest"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/ociimage"
)

// Checkpoints as vmsnap stored them before the checkpoint index: the state
// manifest tagged, naming its disk image in dev.vmsnap.disk.image as
// REF@DIGEST with the registry's host (or the layout's path), the disk
// manifest as its subject, dev.vmsnap.previous on it.

// toLegacy rewrites the checkpoint res, stored in repository repo (a
// reference without tag), as such a checkpoint: its state manifest with
// the old links (diskLink as dev.vmsnap.disk.image; the disk as subject
// when subject is set; previous), tagged tag, and its index and new state
// manifest deleted.
func toLegacy(t *testing.T, repo string, opts []ociimage.Option, res *api.CheckpointResult, diskLink, previous, tag string, subject bool) ocispec.Descriptor {
	t.Helper()
	ctx := context.Background()
	r := openRepo(t, repo, opts)
	state, err := openRepo(t, res.VMState.Image, opts).Resolve(ctx)
	if err != nil {
		t.Fatal(err)
	}
	m, err := r.Manifest(ctx, state)
	if err != nil {
		t.Fatal(err)
	}
	m.Annotations[ociimage.AnnotationDiskImage] = diskLink
	if previous != "" {
		m.Annotations[ociimage.AnnotationPrevious] = previous
	}
	if subject {
		disk, err := openRepo(t, res.Disk.Image, opts).Resolve(ctx)
		if err != nil {
			t.Fatal(err)
		}
		m.Subject = &disk
	}
	legacy, err := r.PutManifest(ctx, m)
	if err != nil {
		t.Fatal(err)
	}
	if err := ociimage.TagManifest(ctx, r, legacy, tag); err != nil {
		t.Fatal(err)
	}
	del := r.(ociimage.ManifestDeleter)
	for _, d := range []string{res.Checkpoint.Digest, res.VMState.Digest} {
		if err := del.DeleteManifest(ctx, digestOf(d)); err != nil {
			t.Fatal(err)
		}
	}
	return legacy
}

// legacyCheckpoints takes n checkpoints into image (a repository) under the
// tags vm and vm-disk, each rewritten as a legacy one chained to the one
// before: the disk link as the old writer wrote it (diskLink of the disk
// image's reference), the disk as subject.
func legacyCheckpoints(t *testing.T, image string, opts []ociimage.Option, n int, diskLink func(string) string) (string, []taken) {
	t.Helper()
	overlay, cps := fourCheckpoints(t, image, opts)
	previous := ""
	for i := range cps[:n] {
		cp := &cps[i]
		legacy := toLegacy(t, image, opts, cp.res, diskLink(cp.res.Disk.Image), previous, "vm", true)
		previous = legacy.Digest.String()
		cp.res.Checkpoint = nil
		cp.res.VMState.Digest, cp.res.VMState.Image = previous, image+"@"+previous
	}
	return overlay, cps[:n]
}

// TestLegacyCheckpointStillRestoresAndInspects: a checkpoint stored before
// the index restores (state and disk, by their digests), inspect of its tag
// follows its disk annotation, and inspect of the disk lists the state
// image whose subject it is.
func TestLegacyCheckpointStillRestoresAndInspects(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	overlay, cps := legacyCheckpoints(t, "oci:"+dir, nil, 2, func(s string) string { return s })
	for _, cp := range cps {
		restoresExactly(t, overlay, cp, nil)
	}
	last := cps[1].res
	ins, err := Inspect(ctx, InspectSpec{Image: "oci:" + dir + ":vm"})
	if err != nil {
		t.Fatal(err)
	}
	if c := ins.Checkpoint; c == nil || c.Image != "" || c.VMState != last.VMState.Image || c.Disk != last.Disk.Image || ins.LinkedDisk == nil {
		t.Fatalf("inspect of a legacy checkpoint: %+v", ins.Checkpoint)
	}
	disk, err := Inspect(ctx, InspectSpec{Image: last.Disk.Image})
	if err != nil || len(disk.Referrers) != 1 || disk.Referrers[0].Digest != last.VMState.Digest {
		t.Fatalf("inspect of a legacy disk: %+v, %v", disk.Referrers, err)
	}
}

// TestLegacyLinkIsFollowedOnTheRegistryItIsReadFrom: a checkpoint stored
// before the index names its disk with the host of the registry it was
// pushed to. Copied elsewhere, inspect of the copy must read the disk from
// the registry the copy is in, never go back to that host: here a
// listener that counts who connects.
func TestLegacyLinkIsFollowedOnTheRegistryItIsReadFrom(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var contacted atomic.Int32
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			contacted.Add(1)
			c.Close()
		}
	}()
	reg := registry.Start(t)
	opts := append(registryOpts(reg), ociimage.WithRetry(1, 0))
	image := reg.Host + "/vms/vm1"
	_, cps := legacyCheckpoints(t, image, opts, 1, func(s string) string { return strings.Replace(s, reg.Host, ln.Addr().String(), 1) })
	ins, err := Inspect(context.Background(), InspectSpec{Image: image + ":vm", Store: opts})
	if err != nil || ins.Checkpoint == nil || ins.Checkpoint.Disk != cps[0].res.Disk.Image {
		t.Fatalf("inspect of the copy: %+v, %v", ins, err)
	}
	if n := contacted.Load(); n != 0 {
		t.Fatalf("inspect connected %d times to the host the annotation names", n)
	}
}

// TestPruneFollowsALegacyChainIntoIndexes: two checkpoints from before the
// index, then two with it, under one tag: the first index links to the last
// legacy state manifest, and prune --keep 2 keeps the two indexes and
// removes the legacy ones with their disk images.
func TestPruneFollowsALegacyChainIntoIndexes(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	image := "oci:" + dir
	overlay, cps := fourCheckpoints(t, image, nil)
	// Make the first two legacy, as if an older vmsnap had taken them, and
	// link the third's index to the second: rewrite the third and fourth
	// as the chain a new vmsnap writes after an old one.
	l1 := toLegacy(t, image, nil, cps[0].res, cps[0].res.Disk.Image, "", "vm", true)
	l2 := toLegacy(t, image, nil, cps[1].res, cps[1].res.Disk.Image, l1.Digest.String(), "vm", true)
	repo := openRepo(t, image, nil)
	third := relinkIndex(t, repo, cps[2].res, l2.Digest.String())
	fourth := relinkIndex(t, repo, cps[3].res, third.Digest.String())
	if err := ociimage.TagManifest(ctx, repo, fourth, "vm"); err != nil {
		t.Fatal(err)
	}
	res, err := Prune(ctx, PruneSpec{Repo: image, Keep: 2})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(prunetest.Digests(res.Kept), []string{fourth.Digest.String(), third.Digest.String()}) ||
		!slices.Equal(prunetest.Digests(res.Removed), []string{l2.Digest.String(), l1.Digest.String()}) {
		t.Fatalf("kept %v removed %v", prunetest.Digests(res.Kept), prunetest.Digests(res.Removed))
	}
	for _, d := range []string{l1.Digest.String(), l2.Digest.String(), cps[0].res.Disk.Digest, cps[1].res.Disk.Digest} {
		if !prunetest.ManifestGone(t, image, d, nil) {
			t.Fatalf("%s of a removed legacy checkpoint is still there", d)
		}
	}
	for _, cp := range cps[2:] {
		restoresExactly(t, overlay, cp, nil)
	}
}

// relinkIndex stores the index of checkpoint res again with previous as
// its link, deletes the old one, and returns the new.
func relinkIndex(t *testing.T, repo ociimage.Repository, res *api.CheckpointResult, previous string) ocispec.Descriptor {
	t.Helper()
	ctx := context.Background()
	old, err := repo.(ociimage.DigestResolver).ResolveDigest(ctx, digestOf(res.Checkpoint.Digest))
	if err != nil {
		t.Fatal(err)
	}
	idx, err := repo.Index(ctx, old)
	if err != nil {
		t.Fatal(err)
	}
	idx.Annotations[ociimage.AnnotationPrevious] = previous
	desc, err := repo.PutIndex(ctx, idx)
	if err != nil {
		t.Fatal(err)
	}
	if err := repo.(ociimage.ManifestDeleter).DeleteManifest(ctx, old.Digest); err != nil {
		t.Fatal(err)
	}
	res.Checkpoint.Digest = desc.Digest.String()
	return desc
}

// TestPruneRegistryRemovesLegacyFallbackTags: checkpoints from before the
// index have their disk as subject, which distribution 2.8 records in the
// referrers fallback tag sha256-HEX; prune deletes those of the disks it
// removes and keeps the kept ones'.
func TestPruneRegistryRemovesLegacyFallbackTags(t *testing.T) {
	reg := registry.Start(t)
	opts := registryOpts(reg)
	image := reg.Host + "/vms/vm1"
	overlay, cps := legacyCheckpoints(t, image, opts, 4, func(s string) string { return s })
	fallback := func(d string) string { return strings.Replace(d, ":", "-", 1) }
	for _, cp := range cps {
		if !slices.Contains(reg.Tags(t, "vms/vm1"), fallback(cp.res.Disk.Digest)) {
			t.Fatalf("no fallback tag for disk %s: the test needs them", cp.res.Disk.Digest)
		}
	}
	res, err := Prune(context.Background(), PruneSpec{Repo: image, Keep: 2, Store: opts})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(prunetest.Digests(res.Removed), []string{cps[1].res.VMState.Digest, cps[0].res.VMState.Digest}) {
		t.Fatalf("removed %v", prunetest.Digests(res.Removed))
	}
	after := reg.Tags(t, "vms/vm1")
	for i, cp := range cps {
		if slices.Contains(after, fallback(cp.res.Disk.Digest)) != (i >= 2) {
			t.Fatalf("the fallback tag of disk %d: tags %v", i, after)
		}
	}
	for _, cp := range cps[2:] {
		restoresExactly(t, overlay, cp, opts)
	}
}

func digestOf(s string) digest.Digest { return digest.Digest(s) }
