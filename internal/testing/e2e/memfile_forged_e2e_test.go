package e2e

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/testing/forge"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/vmstate"
)

// Issue 21, HIGH 2, on a real guest: someone who may write the VM's tag
// (and read its repository) plants a parent whose page map carries the
// guest's xxhash64 for every page and the SHA-256 of pages of their own
// over its first 4 MiB (internal/testing/forge). The guest's next checkpoint under the
// tag must restore exactly the guest's memory: the prepared RAM file is
// compared byte for byte with the stopped guest's, and a QEMU restored on
// it carries on.
func TestMemoryFileE2EForgedParentUnderTheTag(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	dir := guest.FreeShortDir(t)
	shm := shmDir(t)
	overlay := guest.NewDisk(t, dir)
	const memMB = 256
	ram := filepath.Join(shm, "src.ram")
	src, before := bootGuest(t, guest.Options{Disk: overlay, Dir: dir, ExtraArgs: fileRAMArgs(ram, memMB)})
	store := filepath.Join(t.TempDir(), "store")
	records := filepath.Join(shm, "records")
	cp1 := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":vm", "--mode", "snapshot", "--parent-records", records)

	ctx := context.Background()
	repo, err := ociimage.Open(ctx, ociimage.Reference{Layout: store})
	if err != nil {
		t.Fatal(err)
	}
	victim, err := repo.ResolveTag(ctx, "vm")
	if err != nil || victim.Digest.String() != cp1.Checkpoint.Digest {
		t.Fatalf("the tag names %s (%v), want the checkpoint %s", victim.Digest, err, cp1.Checkpoint.Digest)
	}
	forged, pages, err := forge.Parent(ctx, repo, victim, 4<<20, 99, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if err := ociimage.TagManifest(ctx, repo, forged, "vm"); err != nil {
		t.Fatal(err)
	}
	t.Logf("forged parent %s under the tag: %d of the guest's pages vouched for with the attacker's hashes", forged.Digest, len(pages))

	// Pause mode: the guest stays stopped, so its RAM file is its memory
	// at the checkpoint.
	cp2 := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":vm", "--mode", "pause",
		"--disk", overlay, "--disk-image", "oci:"+store+":vm-disk", "--parent-records", records)
	r := cp2.VMState.RAM
	if r.Parent == forged.Digest.String() {
		t.Errorf("the checkpoint built on the parent planted under its tag")
	} else if r.Parent != cp1.VMState.Digest || r.ParentTrust != vmstate.ParentRecorded {
		t.Errorf("parent %q (%s; %s), want the recorded %s", r.Parent, r.ParentTrust, r.BaseNote, cp1.VMState.Digest)
	}
	resume := src.ResumeCounter()

	p := cliJSON[api.PrepareResult](t, "prepare", cp2.VMState.Image, "--cache-dir", filepath.Join(shm, "cache"))
	got, err := os.ReadFile(p.MemoryFile)
	if err != nil {
		t.Fatal(err)
	}
	want, err := os.ReadFile(ram)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("the prepared RAM file is not the guest's memory: first difference at byte %d (page %d)", i, i/4096)
			}
		}
	}
	src.Kill()
	tdir := targetDir(t, dir)
	vm := guest.Start(t, guest.Options{Dir: tdir, Incoming: true, Disk: restoreDisk(t, cp2, tdir, "target.qcow2"), ExtraArgs: p.QEMUArgs})
	rs := cliJSON[api.RestoreResult](t, "restore", "--qmp", vm.QMPPath(), "--image", cp2.VMState.Image)
	if rs.VMState == nil {
		t.Fatalf("restore: %+v", rs)
	}
	if !rs.VMState.VMRunning { // the source was stopped
		qmpOnce(t, vm.QMPPath(), "cont", nil)
	}
	assertResumed(t, vm, before, resume, resume)
}
