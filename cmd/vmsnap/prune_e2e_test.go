package main

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testguest"
)

// TestE2EPruneKeepsRestorableCheckpoints: three snapshot-mode checkpoints
// of a real guest under one tag; the third, with --keep 2, removes the
// first. The second, which no tag names any more (found through the
// third's previous link), then restores exactly: same boot id, memory and
// disk, the counter carrying on from when it was taken.
func TestE2EPruneKeepsRestorableCheckpoints(t *testing.T) {
	dir := testguest.FreeShortDir(t)
	src, before := bootSource(t, dir)
	store := "oci:" + filepath.Join(t.TempDir(), "store")
	checkpoint := func(extra ...string) api.CheckpointResult {
		t.Helper()
		last, _ := src.LastStatus()
		if _, err := src.WaitStatus(waitCtx(t), func(s testguest.Status) bool { return s.Counter > last.Counter }); err != nil {
			t.Fatal(err)
		}
		return cliJSON[api.CheckpointResult](t, append([]string{"checkpoint", "--qmp", src.QMPPath(), "--image", store + ":vm1",
			"--disk", filepath.Join(dir, "overlay.qcow2"), "--disk-image", store + ":vm1-disk", "--mode", "snapshot"}, extra...)...)
	}
	first := checkpoint()
	beforeSecond, _ := src.LastStatus()
	second := checkpoint()
	afterSecond, _ := src.LastStatus()
	third := checkpoint("--keep", "2")

	p := third.Pruned
	if p == nil || p.Error != nil || len(p.Kept) != 2 || len(p.Removed) != 1 || p.Removed[0].Digest != first.VMState.Digest ||
		p.Kept[0].Digest != third.VMState.Digest || p.Kept[1].Digest != second.VMState.Digest || p.Kept[0].Previous != second.VMState.Digest ||
		len(p.RemovedImages) != 1 || !strings.HasSuffix(p.RemovedImages[0].Image, first.Disk.Digest) || p.RemovedBlobs == 0 {
		t.Fatalf("the third checkpoint's prune: %+v", p)
	}
	if doc := cliError(t, errcode.RegistryError, "inspect", first.VMState.Image); !strings.Contains(doc.Error.Message, first.VMState.Digest) {
		t.Fatalf("inspect of the pruned checkpoint: %s", doc.Error.Message)
	}

	// A dry run with --keep 1 would remove the second; it stays.
	dry := cliJSON[api.PruneResult](t, "prune", store, "--keep", "1", "--dry-run")
	if !dry.DryRun || len(dry.Removed) != 1 || dry.Removed[0].Digest != second.VMState.Digest || dry.Removed[0].Tags != nil {
		t.Fatalf("dry run: %+v", dry)
	}

	tdir := targetDir(t, dir)
	disk := filepath.Join(tdir, "overlay.qcow2")
	cliJSON[api.RestoreResult](t, "restore", "--disk-image", second.Disk.Image, "--disk", disk)
	target := startTarget(t, tdir, disk, 0)
	cliJSON[api.RestoreResult](t, "restore", "--qmp", target.QMPPath(), "--image", second.VMState.Image)
	assertResumed(t, target, before, beforeSecond.Counter+1, afterSecond.Counter+1)
}

func TestPruneHelpAndUsage(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"prune", "--help"}, &stdout, &stderr); code != 0 {
		t.Fatalf("prune --help: exit %d", code)
	}
	for _, want := range []string{"Usage:", "--keep", "--dry-run", "--json", "--registry-config", "--ca-file", "--insecure-registry",
		"dev.vmsnap.previous", "storage.delete", "Never deleted", "Exit status"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("prune --help lacks %q", want)
		}
	}
	dir := t.TempDir()
	cliError(t, errcode.Usage, "prune", "oci:"+dir)
	cliError(t, errcode.Usage, "prune", "oci:"+dir, "--keep", "0")
	cliError(t, errcode.Usage, "prune", "oci:"+dir+":vm", "--keep", "1")
	cliError(t, errcode.Usage, "prune", "--keep", "1")
	cliError(t, errcode.RegistryError, "prune", "oci:"+filepath.Join(dir, "missing"), "--keep", "1")
	cliError(t, errcode.Usage, "checkpoint", "--qmp", "/nonexistent", "--image", "oci:"+dir+":vm", "--keep", "-1")
}
