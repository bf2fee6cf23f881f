package e2e

import (
	"path/filepath"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/vmstate"
)

// Snapshot-mode memory-file checkpoints of a busy guest (1 GiB, 256 MiB of
// random data it checksums every 15 status lines) are pre-copies taken
// while it runs: each one, restored into a fresh QEMU mapping its prepared
// file, carries on exactly (same boot, its memory checksum intact at later
// counters, the counter where the snapshot caught it). QEMU 10: under TCG,
// QEMU 7.2's dirty log loses writes, and vmsnap scans its VMs instead.
func TestMemoryFileE2EPrecopySnapshotsRestoreExactly(t *testing.T) {
	t.Parallel()
	root := guest.QEMU10(t)
	guest.Assets(t)
	dir := guest.FreeShortDir(t)
	shm := shmDir(t)
	const memMB, dataMB = 1024, 256
	opts := func(o guest.Options) guest.Options {
		o.MemMB, o.GuestMemMB, o.KernelArgs, o.QEMURoot = memMB, dataMB, []string{"vmsnap.mem_every=15"}, root
		return o
	}
	src, boot := bootGuest(t, opts(guest.Options{Disk: guest.NewDisk(t, dir), Dir: dir, ExtraArgs: fileRAMArgs(filepath.Join(shm, "src.ram"), memMB)}))
	store := filepath.Join(t.TempDir(), "store")
	for i := range 4 {
		last, _ := src.LastStatus()
		cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":vm", "--mode", "snapshot")
		if r := cp.VMState.RAM; r == nil || r.Capture != vmstate.CapturePrecopy || len(r.Chain) != i+1 {
			t.Fatalf("checkpoint %d: ram %+v: want a pre-copy, link %d of the chain", i, cp.VMState.RAM, i+1)
		}
		printed, _ := src.LastStatus()
		after, err := src.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > printed.Counter })
		if err != nil {
			t.Fatalf("the source does not run on after checkpoint %d: %v", i, err)
		}
		cache := filepath.Join(shm, "cache")
		p := cliJSON[api.PrepareResult](t, "prepare", cp.VMState.Image, "--cache-dir", cache)
		target := guest.Start(t, opts(guest.Options{Dir: targetDir(t, dir), Incoming: true, Disk: guest.NewDisk(t, guest.FreeShortDir(t)), ExtraArgs: p.QEMUArgs}))
		cliJSON[api.RestoreResult](t, "restore", "--qmp", target.QMPPath(), "--image", cp.VMState.Image, "--cache-dir", cache)
		first, err := target.WaitStatus(waitCtx(t), func(guest.Status) bool { return true })
		if err != nil || first.Boot != boot.Boot || first.Counter <= last.Counter || first.Counter > after.Counter {
			t.Fatalf("checkpoint %d restored: %+v, %v (source: before %d, after %d)\n%s", i, first, err, last.Counter, after.Counter, target.SerialTail(20))
		}
		// Past the guest's next checksum of its data: the memory is exact.
		checked, err := target.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > first.Counter+15 })
		if err != nil || checked.Mem != boot.Mem0 || checked.Mem0 != boot.Mem0 {
			t.Fatalf("checkpoint %d restored: %+v, %v: memory checksum, want %s\n%s", i, checked, err, boot.Mem0, target.SerialTail(20))
		}
		target.Kill()
	}
}
