package e2e

// End-to-end tests of the mapped-ram path on a real QEMU 10 (Debian
// bookworm-backports' packages, unpacked into the test cache by
// testguest.QEMU10), beside the system's QEMU 7.2.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	testguest "github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

const (
	mappedMemMB  = 512
	mappedDataMB = 64
)

// assertEmptyDir fails t if dir holds anything: staging leaves nothing.
func assertEmptyDir(t *testing.T, dir string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		t.Errorf("left behind in the staging directory %s: %s", dir, e.Name())
	}
}

func stateFormat(t *testing.T, image string) vmspec.Format {
	t.Helper()
	ins := cliJSON[snapshot.InspectResult](t, "inspect", image)
	if ins.VMState == nil {
		t.Fatalf("inspect %s shows no VM state config", image)
	}
	return ins.VMState.Format
}

func TestMappedRAME2EQEMU10(t *testing.T) {
	t.Parallel()
	root := testguest.QEMU10(t)
	testguest.Assets(t)
	dir := testguest.FreeShortDir(t)
	overlay := testguest.NewDisk(t, dir)
	guest := func(o testguest.Options) testguest.Options {
		o.MemMB, o.GuestMemMB = mappedMemMB, mappedDataMB
		return o
	}
	src, before := bootGuest(t, guest(testguest.Options{Disk: overlay, Dir: dir, QEMURoot: root}))
	if before.Mem != before.Mem0 || !strings.HasPrefix(before.Disk, testguest.MarkerPrefix) {
		t.Fatalf("source guest is not healthy before the checkpoint: %s", before)
	}
	store := filepath.Join(t.TempDir(), "store")
	staging := t.TempDir()

	// 1. Snapshot mode, default format: QEMU 10 has mapped-ram, so that is
	// what is used; the VM runs again before the upload is done. (1 MiB
	// chunks: QEMU aligns each RAMBlock's pages to 1 MiB in the file.)
	cp1 := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":snap",
		"--disk", overlay, "--disk-image", "oci:"+store+":snap-disk", "--mode", "snapshot", "--staging-dir", staging,
		"--chunk-size", "1048576")
	if !cp1.VMRunning || runState(t, src) != "running" {
		t.Fatal("snapshot mode did not continue the source")
	}
	if f := stateFormat(t, cp1.VMState.Image); f != vmspec.FormatMappedRAM {
		t.Fatalf("the snapshot's format is %q, want %q", f, vmspec.FormatMappedRAM)
	}
	if !strings.HasPrefix(cp1.VMState.QEMUVersion, "10.") || cp1.VMState.MemoryBytes != mappedMemMB<<20 {
		t.Fatalf("recorded QEMU %s with %d bytes", cp1.VMState.QEMUVersion, cp1.VMState.MemoryBytes)
	}
	// The VM ran again once QEMU had written the file (and the disk was
	// captured): the upload of the state came after.
	stored := cp1.VMState.DurationsMs["stream"]
	t.Logf("snapshot: downtime %.0f ms, stream (QEMU's save + chunks) %.0f ms, total %.0f ms; %d MiB raw, %d MiB stored",
		cp1.DowntimeMs, stored, cp1.TotalMs, cp1.VMState.RawBytes>>20, cp1.VMState.StoredBytes>>20)
	if cp1.DowntimeMs <= 0 || cp1.DowntimeMs >= cp1.TotalMs {
		t.Fatalf("downtime %.0f ms of a %.0f ms checkpoint: the VM was not running again before the upload ended", cp1.DowntimeMs, cp1.TotalMs)
	}
	assertEmptyDir(t, staging)
	last, _ := src.LastStatus()
	if _, err := src.WaitStatus(waitCtx(t), func(s testguest.Status) bool { return s.Counter > last.Counter+1 }); err != nil {
		t.Fatalf("source stopped counting after a snapshot: %v", err)
	}

	// 2. A second checkpoint after the guest ran a little uploads little:
	// the chunks sit at fixed offsets, and most of memory did not change.
	cp2 := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":snap2",
		"--mode", "snapshot", "--staging-dir", staging, "--chunk-size", "1048576")
	ratio := float64(cp2.VMState.UploadedBytes) / float64(cp1.VMState.StoredBytes)
	t.Logf("second checkpoint: %d of %d bytes uploaded (%.1f%% of the first's), %d chunks",
		cp2.VMState.UploadedBytes, cp2.VMState.StoredBytes, 100*ratio, cp2.VMState.Chunks)
	if ratio > 0.10 {
		t.Fatalf("the second checkpoint uploaded %.1f%% of the first's bytes, want at most 10%%", 100*ratio)
	}

	// 3. Pause mode, then a restore into a fresh QEMU 10: the guest carries
	// on exactly where it stopped.
	cp3 := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":pause",
		"--disk", overlay, "--disk-image", "oci:"+store+":pause-disk", "--mode", "pause", "--format", "mapped-ram", "--staging-dir", staging)
	if cp3.VMRunning || runState(t, src) == "running" {
		t.Fatal("pause mode left the source running")
	}
	if f := stateFormat(t, cp3.VMState.Image); f != vmspec.FormatMappedRAM {
		t.Fatalf("the pause-mode snapshot's format is %q", f)
	}
	resume := src.ResumeCounter()
	now, _ := src.LastStatus()
	src.Kill()
	assertEmptyDir(t, staging)

	restoreInto := func(cp api.CheckpointResult) *testguest.VM {
		t.Helper()
		tdir := targetDir(t, dir)
		disk := filepath.Join(tdir, "overlay.qcow2")
		cliJSON[api.RestoreResult](t, "restore", "--disk-image", cp.Disk.Image, "--disk", disk)
		target := testguest.Start(t, guest(testguest.Options{Disk: disk, Dir: tdir, Incoming: true, QEMURoot: root}))
		rstaging := t.TempDir()
		rs := cliJSON[api.RestoreResult](t, "restore", "--qmp", target.QMPPath(), "--image", cp.VMState.Image, "--staging-dir", rstaging)
		if rs.VMState == nil || !rs.VMState.VMRunning || rs.VMState.RawBytes != cp.VMState.RawBytes {
			t.Fatalf("state restore result: %+v", rs)
		}
		t.Logf("restore of %d MiB: %.0f ms", rs.VMState.RawBytes>>20, rs.VMState.DurationsMs["total"])
		assertEmptyDir(t, rstaging)
		return target
	}
	target := restoreInto(cp3)
	if st := runState(t, target); st != "running" {
		t.Fatalf("target is %s after restore", st)
	}
	assertResumed(t, target, before, resume, resume)

	// The snapshot-mode image restores too: at the moment of the snapshot.
	assertResumed(t, restoreInto(cp1), before, before.Counter+1, now.Counter+1)

	// 4. A QEMU 7.2 cannot load mapped-ram: refused before anything is fed.
	old := testguest.Start(t, guest(testguest.Options{Dir: testguest.FreeShortDir(t), Incoming: true}))
	doc := cliError(t, errcode.CompatMismatch, "restore", "--qmp", old.QMPPath(), "--image", cp1.VMState.Image)
	if !strings.Contains(strings.Join(doc.Error.Details, "\n"), "lacks the mapped-ram migration capability") ||
		!strings.Contains(doc.Error.Message, "mapped-ram") {
		t.Fatalf("the refusal does not say that QEMU 7.2 lacks mapped-ram: %+v", doc.Error)
	}
	if st := runState(t, old); st != "inmigrate" {
		t.Fatalf("the QEMU 7.2 target is %s after a refused restore, want inmigrate (untouched)", st)
	}
}

// Figures for docs/performance.md (not run by default): a 1 GiB guest with 256 MiB
// of random data on QEMU 10, checkpointed into an OCI layout with each
// format in turn, in snapshot and pause modes, and restored.
//
//	VMSNAP_MAPPEDRAM_FIGURES=3 go test -run TestMappedRAMFigures -v -timeout 30m ./cmd/vmsnap/
func TestMappedRAMFigures(t *testing.T) {
	t.Parallel()
	rounds := 0
	fmt.Sscan(os.Getenv("VMSNAP_MAPPEDRAM_FIGURES"), &rounds)
	if rounds <= 0 {
		t.Skip("set VMSNAP_MAPPEDRAM_FIGURES=ROUNDS to measure the formats on QEMU 10")
	}
	root := testguest.QEMU10(t)
	testguest.Assets(t)
	const memMB, dataMB = 1024, 256
	src := testguest.Start(t, testguest.Options{MemMB: memMB, GuestMemMB: dataMB, QEMURoot: root})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if _, err := src.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	store := filepath.Join(t.TempDir(), "store")
	type row struct{ total, downtime, stream, restore []float64 }
	rows := map[string]*row{}
	var order []string
	for r := range rounds {
		for _, mode := range []string{"snapshot", "pause"} {
			for _, format := range []string{"stream", "mapped-ram"} {
				key := mode + " " + format
				if rows[key] == nil {
					rows[key] = &row{}
					order = append(order, key)
				}
				// A fresh store each time: every chunk is uploaded.
				img := fmt.Sprintf("oci:%s-%d-%s-%s", store, r, mode, format)
				cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", img, "--mode", mode, "--format", format)
				rw := rows[key]
				rw.total = append(rw.total, cp.TotalMs)
				rw.downtime = append(rw.downtime, cp.DowntimeMs)
				rw.stream = append(rw.stream, cp.VMState.DurationsMs["stream"])
				if mode == "pause" {
					// Restore it into a fresh QEMU 10; the source goes on.
					target := testguest.Start(t, testguest.Options{MemMB: memMB, GuestMemMB: dataMB, QEMURoot: root, Incoming: true})
					rs := cliJSON[api.RestoreResult](t, "restore", "--qmp", target.QMPPath(), "--image", cp.VMState.Image)
					rw.restore = append(rw.restore, rs.VMState.DurationsMs["total"])
					target.Kill()
					if _, err := src.QMP(ctx, "cont", nil); err != nil {
						t.Fatal(err)
					}
				}
			}
		}
	}
	// What a second checkpoint uploads after the VM ran 10 s, per format
	// and chunk size.
	var incr []string
	for _, format := range []string{"stream", "mapped-ram"} {
		for _, chunk := range []string{"1048576", "4194304"} {
			img := fmt.Sprintf("oci:%s-incr-%s-%s", store, format, chunk)
			args := []string{"checkpoint", "--qmp", src.QMPPath(), "--image", img, "--mode", "snapshot", "--format", format, "--chunk-size", chunk}
			first := cliJSON[api.CheckpointResult](t, args...)
			time.Sleep(10 * time.Second)
			second := cliJSON[api.CheckpointResult](t, args...)
			incr = append(incr, fmt.Sprintf("%-10s chunks of %s: second checkpoint after 10 s uploads %.1f%% of the first's %d MiB",
				format, chunk, 100*float64(second.VMState.UploadedBytes)/float64(first.VMState.StoredBytes), first.VMState.StoredBytes>>20))
		}
	}
	med := func(v []float64) string {
		if len(v) == 0 {
			return "-"
		}
		s := append([]float64(nil), v...)
		for i := range s {
			for j := i + 1; j < len(s); j++ {
				if s[j] < s[i] {
					s[i], s[j] = s[j], s[i]
				}
			}
		}
		return fmt.Sprintf("%.2f s", s[len(s)/2]/1000)
	}
	t.Logf("QEMU %s, %d MiB guest with %d MiB random data, median of %d, into an OCI layout:", testguest.QEMU10Version, memMB, dataMB, rounds)
	t.Logf("%-20s %10s %10s %10s %10s", "mode format", "total", "downtime", "stream", "restore")
	for _, k := range order {
		rw := rows[k]
		t.Logf("%-20s %10s %10s %10s %10s", k, med(rw.total), med(rw.downtime), med(rw.stream), med(rw.restore))
	}
	for _, l := range incr {
		t.Log(l)
	}
}
