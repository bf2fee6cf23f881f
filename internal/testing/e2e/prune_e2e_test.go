package e2e

import (
	"bytes"
	"crypto/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// TestE2EPruneKeepsRestorableCheckpoints: three snapshot-mode checkpoints
// of a real guest under one tag; the third, with --keep 2, removes the
// first. The second, which no tag names any more (found through the
// third's previous link), then restores exactly: same boot id, memory and
// disk, the counter carrying on from when it was taken.
func TestE2EPruneKeepsRestorableCheckpoints(t *testing.T) {
	t.Parallel()
	dir := guest.FreeShortDir(t)
	src, before := bootSource(t, dir)
	store := "oci:" + filepath.Join(t.TempDir(), "store")
	checkpoint := func(extra ...string) api.CheckpointResult {
		t.Helper()
		last, _ := src.LastStatus()
		if _, err := src.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > last.Counter }); err != nil {
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
	if p == nil || p.Error != nil || len(p.Kept) != 2 || len(p.Removed) != 1 || p.Removed[0].Digest != first.Checkpoint.Digest ||
		p.Kept[0].Digest != third.Checkpoint.Digest || p.Kept[1].Digest != second.Checkpoint.Digest || p.Kept[0].Previous != second.Checkpoint.Digest ||
		len(p.RemovedImages) != 2 || p.RemovedImages[0].Image != first.VMState.Image || p.RemovedImages[1].Image != first.Disk.Image || p.RemovedBlobs == 0 {
		t.Fatalf("the third checkpoint's prune: %+v", p)
	}
	if doc := cliError(t, errcode.RegistryError, "inspect", first.VMState.Image); !strings.Contains(doc.Error.Message, first.VMState.Digest) {
		t.Fatalf("inspect of the pruned checkpoint: %s", doc.Error.Message)
	}

	// A dry run with --keep 1 would remove the second; it stays.
	dry := cliJSON[api.PruneResult](t, "prune", store, "--keep", "1", "--dry-run")
	if !dry.DryRun || len(dry.Removed) != 1 || dry.Removed[0].Digest != second.Checkpoint.Digest || dry.Removed[0].Tags != nil {
		t.Fatalf("dry run: %+v", dry)
	}

	tdir := targetDir(t, dir)
	disk := filepath.Join(tdir, "overlay.qcow2")
	cliJSON[api.RestoreResult](t, "restore", "--disk-image", second.Disk.Image, "--disk", disk)
	target := startTarget(t, tdir, disk, 0)
	cliJSON[api.RestoreResult](t, "restore", "--qmp", target.QMPPath(), "--image", second.VMState.Image)
	assertResumed(t, target, before, beforeSecond.Counter+1, afterSecond.Counter+1)
}

// TestPruneKilledMidwayLeavesTheKeptRestorable: vmsnap prune, a process of
// its own, is killed with SIGKILL while the registry (behind a proxy) holds
// its third manifest DELETE. Both kept checkpoints then restore exactly, and
// a second prune removes what the first did not reach.
func TestPruneKilledMidwayLeavesTheKeptRestorable(t *testing.T) {
	t.Parallel()
	reg := registry.Start(t)
	proxy := startFaultProxy(t, reg)
	image := proxy.Host + "/vms/vm1"
	overlay := guest.NewDisk(t, t.TempDir())
	type taken struct {
		cp    api.CheckpointResult
		state []byte
		disk  []byte
	}
	var cps []taken
	for i := range 4 {
		if i > 0 {
			f, err := os.OpenFile(overlay, os.O_APPEND|os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			f.Write(make([]byte, 64<<10))
			f.Close()
		}
		state := make([]byte, 1<<20)
		rand.Read(state)
		vm := qmptest.NewFakeQEMU(t, "running", state)
		cp := cliJSON[api.CheckpointResult](t, append([]string{"checkpoint", "--qmp", vm.Path(), "--image", image + ":vm",
			"--disk", overlay, "--disk-image", image + ":vm-disk", "--chunk-size", "262144"}, proxy.args()...)...)
		disk, err := os.ReadFile(overlay)
		if err != nil {
			t.Fatal(err)
		}
		cps = append(cps, taken{cp, state, disk})
	}

	proxy.stallDeletesAfter.Store(2)
	cmd := exec.Command(binary(t), append([]string{"prune", image, "--keep", "2", "--json"}, proxy.args()...)...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-proxy.stalled:
	case <-time.After(2 * time.Minute):
		cmd.Process.Kill()
		t.Fatal("prune never reached its third DELETE")
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	proxy.stallDeletesAfter.Store(0)
	if n := proxy.deletes.Load(); n != 2 {
		t.Fatalf("%d DELETEs went through before the kill, want 2", n)
	}

	restore := func(c taken) {
		t.Helper()
		target := qmptest.NewFakeQEMU(t, "inmigrate", c.state)
		cliJSON[api.RestoreResult](t, append([]string{"restore", "--qmp", target.Path(), "--image", c.cp.VMState.Image}, proxy.args()...)...)
		dst := filepath.Join(filepath.Dir(overlay), "restored.qcow2")
		cliJSON[api.RestoreResult](t, append([]string{"restore", "--disk-image", c.cp.Disk.Image, "--disk", dst}, proxy.args()...)...)
		got, err := os.ReadFile(dst)
		if err != nil || !bytes.Equal(got, c.disk) {
			t.Fatalf("the restored disk of %s differs (%v)", c.cp.VMState.Digest, err)
		}
		os.Remove(dst)
	}
	for _, c := range cps[2:] {
		restore(c)
	}

	res := cliJSON[api.PruneResult](t, append([]string{"prune", image, "--keep", "2"}, proxy.args()...)...)
	if len(res.Kept) != 2 || res.Kept[0].Digest != cps[3].cp.Checkpoint.Digest || res.Kept[1].Digest != cps[2].cp.Checkpoint.Digest {
		t.Fatalf("the second prune kept %+v", res.Kept)
	}
	for _, c := range cps[:2] {
		for _, ref := range []string{c.cp.Checkpoint.Image, c.cp.VMState.Image, c.cp.Disk.Image} {
			if doc := cliError(t, errcode.RegistryError, append([]string{"inspect", ref}, proxy.args()...)...); !strings.Contains(doc.Error.Message, "no manifest") {
				t.Fatalf("inspect of pruned %s: %s", ref, doc.Error.Message)
			}
		}
	}
	for _, c := range cps[2:] {
		restore(c)
	}
}
