package e2e

// End-to-end tests of the memory-file format: a guest whose RAM is a shared
// memory-backend-file, checkpointed as a chain of page deltas, prepared into
// a node cache and restored into QEMUs that map that file private.

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/vmstate"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

// shmDir is a fresh directory on tmpfs, where guest RAM files belong.
func shmDir(t testing.TB) string {
	t.Helper()
	if fi, err := os.Stat("/dev/shm"); err != nil || !fi.IsDir() {
		guest.SkipOrFail(t, "tmpfs", "no /dev/shm for the guest's RAM file")
	}
	dir, err := os.MkdirTemp("/dev/shm", "vmsnap-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// fileRAMArgs are the QEMU arguments of a guest whose memMB of RAM is the
// shared file path.
// checkSnapshotCapture checks how a snapshot of a running guest captured
// its RAM file: by pre-copy where QEMU's dirty log holds every write the
// guest makes (KVM, or QEMU 9.0 and later: qemu9 says the guest's QEMU is),
// else by a scan of the stopped VM's file, saying why.
func checkSnapshotCapture(t testing.TB, ram *api.RAMResult, qemu9 bool) {
	t.Helper()
	if qemu9 || os.Getenv(guest.EnvKVM) == "1" {
		if ram.Capture != vmstate.CapturePrecopy {
			t.Fatalf("a snapshot of a running guest captured its RAM by %q (%s), not by pre-copy", ram.Capture, ram.CaptureNote)
		}
		return
	}
	if ram.Capture != vmstate.CaptureScan || !strings.Contains(ram.CaptureNote, "TCG") {
		t.Fatalf("a snapshot of a QEMU 7.2 guest under TCG captured its RAM by %q (%s): want a scan, saying why", ram.Capture, ram.CaptureNote)
	}
}

func fileRAMArgs(path string, memMB int) []string {
	return []string{"-object", fmt.Sprintf("memory-backend-file,id=ram0,mem-path=%s,share=on,size=%dM", path, memMB), "-machine", "memory-backend=ram0"}
}

func TestMemoryFileE2EChainPrepareAndClones(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	dir := guest.FreeShortDir(t)
	shm := shmDir(t)
	overlay := guest.NewDisk(t, dir)
	const memMB = 256
	src, before := bootGuest(t, guest.Options{Disk: overlay, Dir: dir, ExtraArgs: fileRAMArgs(filepath.Join(shm, "src.ram"), memMB)})
	store := filepath.Join(t.TempDir(), "store")
	image := "oci:" + store + ":vm"

	// 1. A base: auto picks memory-file for a shared RAM file; the VM runs
	// again before the pages are stored.
	cp1 := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", image, "--mode", "snapshot")
	if cp1.VMState.Format != vmspec.FormatMemoryFile || cp1.VMState.RAM == nil {
		t.Fatalf("format %q, ram %+v: want a memory-file image", cp1.VMState.Format, cp1.VMState.RAM)
	}
	ram1 := cp1.VMState.RAM
	if len(ram1.Chain) != 1 || ram1.Parent != "" || ram1.Bytes != memMB<<20 {
		t.Fatalf("first checkpoint is not a base of the whole RAM: %+v", ram1)
	}
	if ram1.DataBytes < 16<<20 || ram1.DataBytes >= memMB<<20 {
		t.Fatalf("the base holds %d bytes of data: the guest has 16 MiB of random data in %d MiB", ram1.DataBytes, memMB)
	}
	if !cp1.VMRunning || cp1.DowntimeMs <= 0 || cp1.DowntimeMs >= cp1.TotalMs {
		t.Fatalf("snapshot mode: running %v, downtime %.0f ms of %.0f ms", cp1.VMRunning, cp1.DowntimeMs, cp1.TotalMs)
	}
	// Snapshot mode of a running VM: QEMU 7.2 under TCG, whose dirty log
	// a pre-copy cannot trust, so a scan of the stopped VM's file.
	checkSnapshotCapture(t, ram1, false)
	t.Logf("base: downtime %.0f ms, total %.0f ms (pre-copy %.0f ms), %d MiB stored, device state %d KiB", cp1.DowntimeMs, cp1.TotalMs, cp1.VMState.DurationsMs["precopy"], cp1.VMState.StoredBytes>>20, cp1.VMState.RawBytes>>10)

	// 2. The guest runs on; the next checkpoint under the tag is a delta
	// that uploads a small part of the image.
	last, _ := src.LastStatus()
	if _, err := src.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > last.Counter+1 }); err != nil {
		t.Fatal(err)
	}
	cp2 := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", image, "--mode", "snapshot")
	ram2 := cp2.VMState.RAM
	if ram2 == nil || len(ram2.Chain) != 2 || ram2.Parent != cp1.VMState.Digest {
		t.Fatalf("second checkpoint is not a delta on the first: %+v", ram2)
	}
	if cp2.VMState.StoredBytes < cp1.VMState.StoredBytes {
		t.Errorf("a delta's image stores %d bytes, less than its parent's %d: storedBytes must count the parent's layers", cp2.VMState.StoredBytes, cp1.VMState.StoredBytes)
	}
	checkSnapshotCapture(t, ram2, false)
	ratio := float64(cp2.VMState.UploadedBytes) / float64(cp2.VMState.StoredBytes)
	t.Logf("delta: %d changed pages, uploaded %d KiB of %d MiB (%.1f%%)", ram2.Chain[1].ChangedPages, cp2.VMState.UploadedBytes>>10, cp2.VMState.StoredBytes>>20, 100*ratio)
	if ratio > 0.05 {
		t.Errorf("a delta after a second of an idle guest uploaded %.1f%% of its image", 100*ratio)
	}

	// 3. A delta on the delta, in pause mode, with the disk.
	cp3 := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", image, "--mode", "pause",
		"--disk", overlay, "--disk-image", "oci:"+store+":vm-disk")
	if r := cp3.VMState.RAM; r == nil || len(r.Chain) != 3 || r.Parent != cp2.VMState.Digest || r.Chain[0].Manifest != cp1.VMState.Digest {
		t.Fatalf("third checkpoint is not base + 2 deltas: %+v", cp3.VMState.RAM)
	}
	if c := cp3.VMState.RAM.Capture; c != vmstate.CaptureScan {
		t.Errorf("pause mode captured the RAM by %q: the VM stays stopped, a scan is the faster way", c)
	}
	resume := src.ResumeCounter()
	src.Kill()

	// inspect shows the chain.
	ins := cliJSON[snapshot.InspectResult](t, "inspect", cp3.VMState.Image)
	if ins.VMState == nil || ins.VMState.Format != vmspec.FormatMemoryFile || ins.VMState.RAM == nil || len(ins.VMState.RAM.Chain) != 3 {
		t.Fatalf("inspect does not show the chain: %+v", ins)
	}

	// 4. Prepare: the first fetches, the second finds the file.
	cache := filepath.Join(shm, "cache")
	p1 := cliJSON[api.PrepareResult](t, "prepare", cp3.VMState.Image, "--cache-dir", cache)
	if p1.FetchedBytes <= 0 || !strings.HasPrefix(p1.MemoryFile, cache+"/") || len(p1.QEMUArgs) != 4 {
		t.Fatalf("first prepare: %+v", p1)
	}
	p2 := cliJSON[api.PrepareResult](t, "prepare", cp3.VMState.Image, "--cache-dir", cache)
	if p2.FetchedBytes != 0 || p2.MemoryFile != p1.MemoryFile {
		t.Fatalf("second prepare fetched %d bytes (file %s, first %s): the cache held it", p2.FetchedBytes, p2.MemoryFile, p1.MemoryFile)
	}
	fileBefore := fileDigest(t, p1.MemoryFile)

	// 5. A target that does not map the prepared file is refused before
	// anything is loaded.
	tdir := targetDir(t, dir)
	// (Private, as prepare's arguments map it, but another file.)
	wrongArgs := fileRAMArgs(filepath.Join(shm, "other.ram"), memMB)
	wrongArgs[1] = strings.Replace(wrongArgs[1], "share=on", "share=off", 1)
	wrong := guest.Start(t, guest.Options{Dir: tdir, Incoming: true, Disk: restoreDisk(t, cp3, tdir, "wrong.qcow2"), ExtraArgs: wrongArgs})
	doc := cliError(t, errcode.CompatMismatch, "restore", "--qmp", wrong.QMPPath(), "--image", cp3.VMState.Image)
	if !strings.Contains(strings.Join(doc.Error.Details, "\n"), "not the RAM file of this image") {
		t.Errorf("the refusal does not name the RAM file: %+v", doc.Error)
	}
	if runState(t, wrong) != "inmigrate" {
		t.Errorf("the refused target is %s, want still waiting", runState(t, wrong))
	}

	// 6. Two clones map the one file; both resume exactly, and the file is
	// unchanged after both guests ran.
	var clones []*guest.VM
	for i := range 2 {
		disk := restoreDisk(t, cp3, tdir, fmt.Sprintf("clone%d.qcow2", i))
		args := append([]string(nil), p1.QEMUArgs...)
		vm := guest.Start(t, guest.Options{Dir: tdir, Incoming: true, Disk: disk, ExtraArgs: args})
		rs := cliJSON[api.RestoreResult](t, "restore", "--qmp", vm.QMPPath(), "--image", cp3.VMState.Image, "--cache-dir", cache)
		if rs.VMState == nil || !rs.VMState.VMRunning || !rs.VMState.FromNode {
			t.Fatalf("clone %d: %+v (want the state read from the node, from the cache prepare filled)", i, rs.VMState)
		}
		t.Logf("clone %d: restore %.0f ms", i, rs.VMState.DurationsMs["total"])
		clones = append(clones, vm)
	}
	for _, vm := range clones {
		assertResumed(t, vm, before, resume, resume)
	}
	if fileDigest(t, p1.MemoryFile) != fileBefore {
		t.Fatal("the cached RAM file changed while clones ran on it")
	}

	// 7. Pause and resume one VM again: restored on its own copy (shared),
	// its next checkpoint under the tag is a small delta on cp3, which
	// restores exactly.
	own := cliJSON[api.PrepareResult](t, "prepare", cp3.VMState.Image, "--cache-dir", cache, "--copy-to", shm)
	if own.FetchedBytes != 0 || own.MemoryFile == p1.MemoryFile || !strings.Contains(strings.Join(own.QEMUArgs, " "), "share=on") {
		t.Fatalf("prepare --copy-to: %+v", own)
	}
	vm := guest.Start(t, guest.Options{Dir: tdir, Incoming: true, Disk: restoreDisk(t, cp3, tdir, "again.qcow2"), ExtraArgs: own.QEMUArgs})
	cliJSON[api.RestoreResult](t, "restore", "--qmp", vm.QMPPath(), "--image", cp3.VMState.Image)
	assertResumed(t, vm, before, resume, resume)
	cp4 := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", vm.QMPPath(), "--image", image, "--mode", "pause",
		"--disk", filepath.Join(tdir, "again.qcow2"), "--disk-image", "oci:"+store+":vm-disk")
	ram4 := cp4.VMState.RAM
	if ram4 == nil || ram4.Parent != cp3.VMState.Digest || len(ram4.Chain) != 4 {
		t.Fatalf("the resumed VM's checkpoint is not a delta on the one it was restored from: %+v", ram4)
	}
	t.Logf("after a resume: %d changed pages, uploaded %d KiB of %d MiB", ram4.Chain[3].ChangedPages, cp4.VMState.UploadedBytes>>10, cp4.VMState.StoredBytes>>20)
	if float64(cp4.VMState.UploadedBytes) > 0.05*float64(cp4.VMState.StoredBytes) {
		t.Errorf("the resumed VM's delta uploaded %d of %d bytes", cp4.VMState.UploadedBytes, cp4.VMState.StoredBytes)
	}
	resume4 := vm.ResumeCounter()
	last4, _ := vm.LastStatus()
	vm.Kill()
	p4 := cliJSON[api.PrepareResult](t, "prepare", cp4.VMState.Image, "--cache-dir", cache)
	vm5 := guest.Start(t, guest.Options{Dir: tdir, Incoming: true, Disk: restoreDisk(t, cp4, tdir, "fifth.qcow2"), ExtraArgs: p4.QEMUArgs})
	cliJSON[api.RestoreResult](t, "restore", "--qmp", vm5.QMPPath(), "--image", cp4.VMState.Image)
	last4.Mem0 = before.Mem0
	assertResumed(t, vm5, last4, resume4, resume4)
}

// restoreDisk restores cp's disk overlay as name in dir.
func restoreDisk(t *testing.T, cp api.CheckpointResult, dir, name string) string {
	t.Helper()
	disk := filepath.Join(dir, name)
	cliJSON[api.RestoreResult](t, "restore", "--disk-image", cp.Disk.Image, "--disk", disk)
	return disk
}

// On QEMU 8.2 and later, prepare's arguments add readonly=on,rom=off:
// QEMU opens the cached file read-only, and the guest still writes (to its
// private pages).
func TestMemoryFileE2EQEMU10MapsTheFileReadOnly(t *testing.T) {
	t.Parallel()
	root := guest.QEMU10(t)
	guest.Assets(t)
	dir := guest.FreeShortDir(t)
	shm := shmDir(t)
	overlay := guest.NewDisk(t, dir)
	const memMB = 256
	src, before := bootGuest(t, guest.Options{Disk: overlay, Dir: dir, QEMURoot: root, ExtraArgs: fileRAMArgs(filepath.Join(shm, "src.ram"), memMB)})
	store := filepath.Join(t.TempDir(), "store")
	// Snapshot mode: QEMU 10's pre-copy stream, rewritten for
	// x-ignore-shared, is what the restore below loads into QEMU 10.
	last, _ := src.LastStatus()
	cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":vm", "--mode", "snapshot",
		"--disk", overlay, "--disk-image", "oci:"+store+":vm-disk")
	if cp.VMState.Format != vmspec.FormatMemoryFile || cp.VMState.RAM == nil {
		t.Fatalf("QEMU 10 with a shared RAM file: format %q", cp.VMState.Format)
	}
	checkSnapshotCapture(t, cp.VMState.RAM, true)
	// The first status the source prints once the checkpoint returned
	// comes after the moment the snapshot caught.
	printed, _ := src.LastStatus()
	after, err := src.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > printed.Counter })
	if err != nil {
		t.Fatalf("the source does not run on after its snapshot: %v", err)
	}
	src.Kill()

	p := cliJSON[api.PrepareResult](t, "prepare", cp.VMState.Image, "--cache-dir", filepath.Join(shm, "cache"))
	if !strings.Contains(strings.Join(p.QEMUArgs, " "), "readonly=on,rom=off") {
		t.Fatalf("prepare's arguments for a QEMU 10 image do not map the file read-only: %q", p.QEMUArgs)
	}
	fileBefore := fileDigest(t, p.MemoryFile)
	tdir := targetDir(t, dir)
	target := guest.Start(t, guest.Options{Dir: tdir, Incoming: true, QEMURoot: root,
		Disk: restoreDisk(t, cp, tdir, "overlay.qcow2"), ExtraArgs: p.QEMUArgs})
	rs := cliJSON[api.RestoreResult](t, "restore", "--qmp", target.QMPPath(), "--image", cp.VMState.Image)
	if rs.VMState == nil || !rs.VMState.VMRunning {
		t.Fatalf("restore: %+v", rs)
	}
	// The guest goes on from where the snapshot caught it: after the
	// last status printed before, before the source's later ones.
	assertResumed(t, target, before, last.Counter+1, after.Counter)

	// QEMU holds the file open read-only.
	fds, err := filepath.Glob(fmt.Sprintf("/proc/%d/fd/*", target.Process().Pid))
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, fd := range fds {
		if dest, err := os.Readlink(fd); err != nil || dest != p.MemoryFile {
			continue
		}
		found = true
		info, err := os.ReadFile(strings.Replace(fd, "/fd/", "/fdinfo/", 1))
		if err != nil {
			t.Fatal(err)
		}
		var flags int
		for _, line := range strings.Split(string(info), "\n") {
			if v, ok := strings.CutPrefix(line, "flags:"); ok {
				fmt.Sscanf(strings.TrimSpace(v), "%o", &flags)
			}
		}
		if flags&3 != os.O_RDONLY {
			t.Errorf("QEMU 10 holds the cached RAM file open with flags %o, not read-only", flags)
		}
	}
	if !found {
		t.Fatalf("QEMU 10 holds no descriptor of %s", p.MemoryFile)
	}
	if fileDigest(t, p.MemoryFile) != fileBefore {
		t.Fatal("the cached RAM file changed while the guest ran on it")
	}
}

// The Kubernetes restore pod's path for a memory-file snapshot, on a real
// QEMU: the init container stages the device state only (restore --to-dir)
// and prepares the RAM file into the pod's own RAM volume (prepare
// --state-dir), and vmsnap launch starts QEMU mapping that file private,
// with -incoming defer, while a detached vmsnap load checks the QEMU and
// loads the device state (x-ignore-shared, which QEMU 7.2 cannot take on
// its command line). The guest carries on; a restart boots cold.
func TestMemoryFileE2ELaunch(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	bin := staticVmsnap(t, t.TempDir())
	dir := guest.FreeShortDir(t)
	shm := shmDir(t)
	const memMB = 256
	src, before := bootGuest(t, guest.Options{Disk: guest.NewDisk(t, dir), Dir: dir, ExtraArgs: fileRAMArgs(filepath.Join(shm, "src.ram"), memMB)})
	store := filepath.Join(guest.FreeShortDir(t), "store")
	cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":vm",
		"--disk", filepath.Join(dir, "overlay.qcow2"), "--disk-image", "oci:"+store+":vm-disk", "--mode", "pause")
	if cp.VMState.Format != vmspec.FormatMemoryFile {
		t.Fatalf("format %s, want memory-file", cp.VMState.Format)
	}
	resume := src.ResumeCounter()
	src.Kill()

	tdir := targetDir(t, dir)
	state, markers, overlay := filepath.Join(tdir, "state"), filepath.Join(tdir, "markers"), filepath.Join(tdir, "overlay.qcow2")
	if err := os.Mkdir(markers, 0o755); err != nil {
		t.Fatal(err)
	}
	// Launch refuses a memory-file snapshot whose RAM file was not prepared.
	rs := cliJSON[api.RestoreResult](t, "restore", "--image", cp.VMState.Image, "--to-dir", state, "--disk-image", cp.Disk.Image, "--disk", overlay, "--marker-dir", markers)
	if rs.Staged == nil || rs.Staged.Format != vmspec.FormatMemoryFile || rs.Staged.Bytes >= 16<<20 {
		t.Fatalf("staged %+v: want the device state only (the guest has 16 MiB of random data in RAM)", rs.Staged)
	}
	var staged int64
	filepath.Walk(state, func(_ string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			staged += fi.Size()
		}
		return nil
	})
	if staged >= 16<<20 {
		t.Errorf("the state directory holds %d bytes: the RAM regions were staged too", staged)
	}
	mon := filepath.Join(tdir, "vmsnap.qmp")
	launcher := []string{bin, "launch", "--state-dir", state, "--qmp", mon, "--marker-dir", markers, "--on-restart", "cold", "--"}
	qmpArgs := []string{"-qmp", "unix:" + mon + ",server=on,wait=off"}
	out, err := exec.Command(bin, append(append(launcher[1:], "qemu-system-x86_64"), qmpArgs...)...).CombinedOutput()
	var exitErr *exec.ExitError
	if !errors.As(err, &exitErr) || exitErr.ExitCode() != errcode.Usage.ExitStatus() || !strings.Contains(string(out), "vmsnap prepare") {
		t.Fatalf("launch without a prepared RAM file: %v\n%s", err, out)
	}
	if ents, _ := os.ReadDir(markers); len(ents) != 1 { // the restore's own marker only
		t.Fatalf("a refused launch claimed the snapshot: %v", ents)
	}

	// The RAM volume: the pod's own copy.
	ram := filepath.Join(shm, "pod-ram", "cache")
	p := cliJSON[api.PrepareResult](t, "prepare", cp.VMState.Image, "--cache-dir", ram, "--state-dir", state)
	if !strings.HasPrefix(p.MemoryFile, ram+"/") {
		t.Fatalf("prepare: %+v", p)
	}
	vm := guest.Start(t, guest.Options{Disk: overlay, Dir: tdir, Launcher: launcher, ExtraArgs: qmpArgs})
	waitLoadedRunning(t, vm)
	assertResumed(t, vm, before, resume, resume)
	if !strings.Contains(vm.Stderr(), "vmsnap load: loaded "+cp.VMState.Digest) {
		t.Errorf("the loader did not say it loaded the snapshot:\n%s", vm.Stderr())
	}
	if _, err := os.Stat(filepath.Join(markers, "loaded-sha256-"+strings.TrimPrefix(cp.VMState.Digest, "sha256:"))); err != nil {
		t.Fatalf("the launcher left no marker: %v", err)
	}
	vm.Kill()
	<-vm.Done()
	// A restart: cold, from the disk, never the old memory again.
	cold := guest.Start(t, guest.Options{Disk: overlay, Dir: tdir, Launcher: launcher, ExtraArgs: qmpArgs})
	if _, err := cold.WaitReady(waitCtx(t)); err != nil {
		t.Fatalf("the restarted QEMU did not boot cold: %v\n%s", err, cold.Stderr())
	}
}
