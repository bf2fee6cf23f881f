package e2e

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

// A restored VM started by vmsnap launch, with a real QEMU: the first start
// loads the snapshot and the guest carries on; after QEMU is killed, the
// next start boots the guest cold from the disk as it is now (a new boot,
// the marker written since), never the old memory; with --on-restart fail
// it does not start at all. The init container's own marker keeps a re-run
// from replacing the overlay. The same for -incoming defer (launch --defer):
// loaded once through the monitor, cold after a restart.
func TestLaunchLoadsOnceThenBootsCold(t *testing.T) {
	t.Parallel()
	guest.Assets(t)
	bin := staticVmsnap(t, t.TempDir())
	srcDir := guest.FreeShortDir(t)
	src, before := bootSource(t, srcDir)
	store := filepath.Join(guest.FreeShortDir(t), "store")
	cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":vm",
		"--disk", filepath.Join(srcDir, "overlay.qcow2"), "--disk-image", "oci:"+store+":vm-disk", "--mode", "pause")
	resume := src.ResumeCounter()
	src.Kill()

	tdir := targetDir(t, srcDir)
	state, markers, overlay := filepath.Join(tdir, "state"), filepath.Join(tdir, "markers"), filepath.Join(tdir, "overlay.qcow2")
	if err := os.Mkdir(markers, 0o755); err != nil {
		t.Fatal(err)
	}
	restore := []string{"restore", "--image", cp.VMState.Image, "--to-dir", state, "--disk-image", cp.Disk.Image, "--disk", overlay, "--marker-dir", markers}
	first := cliJSON[api.RestoreResult](t, restore...)
	if first.AlreadyRestored != "" || first.Disk == nil || first.Staged == nil {
		t.Fatalf("first restore: %+v", first)
	}

	streamMon := filepath.Join(tdir, "stream.qmp")
	launch := func(onRestart string) []string {
		return []string{bin, "launch", "--state-dir", state, "--qmp", streamMon, "--marker-dir", markers, "--on-restart", onRestart, "--"}
	}
	start := func() *guest.VM {
		return guest.Start(t, guest.Options{Disk: overlay, Dir: tdir, Launcher: launch("cold"),
			ExtraArgs: []string{"-qmp", "unix:" + streamMon + ",server=on,wait=off"}})
	}

	// 1. First start: loaded once, continued, the guest carries on.
	vm := start()
	waitLoadedRunning(t, vm)
	assertResumed(t, vm, before, resume, resume)
	loaded := filepath.Join(markers, "loaded-sha256-"+strings.TrimPrefix(cp.VMState.Digest, "sha256:"))
	if _, err := os.Stat(loaded); err != nil {
		t.Fatalf("the launcher left no marker: %v", err)
	}

	// 2. QEMU dies; meanwhile the disk holds what the guest wrote since.
	vm.Kill()
	<-vm.Done()
	const written = "vmsnap-marker-written-after-restore"
	sector := filepath.Join(t.TempDir(), "sector")
	if err := os.WriteFile(sector, append([]byte(written), make([]byte, 512-len(written))...), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write -s "+sector+" 0 512", overlay).CombinedOutput(); err != nil {
		t.Fatalf("qemu-io: %v\n%s", err, out)
	}

	// The init container runs again in the same pod: nothing replaced.
	st0, sum0 := hardStat(t, overlay), hardFileSum(t, overlay)
	again := cliJSON[api.RestoreResult](t, restore...)
	if st1 := hardStat(t, overlay); again.AlreadyRestored == "" || st1.Ino != st0.Ino || st1.Mtim != st0.Mtim || hardFileSum(t, overlay) != sum0 {
		t.Fatalf("the re-run restore replaced the overlay (result %+v)", again)
	}

	// 3. Restart, cold: a new boot from the disk as it is, not the snapshot.
	vm = start()
	ready, err := vm.WaitReady(waitCtx(t))
	if err != nil {
		t.Fatalf("the restarted guest did not boot: %v\n%s\n%s", err, vm.SerialTail(20), vm.Stderr())
	}
	if ready.Boot == before.Boot || ready.Disk != written || ready.Mem0 == before.Mem0 {
		t.Fatalf("restart: boot %s (source %s), disk %q (want %q), mem0 %s (source %s): want a cold boot from the disk as written",
			ready.Boot, before.Boot, ready.Disk, written, ready.Mem0, before.Mem0)
	}
	if st, err := vm.WaitStatus(waitCtx(t), func(guest.Status) bool { return true }); err != nil || st.Counter > 3 || st.Boot != ready.Boot {
		t.Fatalf("restart: first status %+v (%v), want the counter of a fresh boot", st, err)
	}
	if cmdline, err := os.ReadFile("/proc/" + itoa(vm.Process().Pid) + "/cmdline"); err != nil || bytes.Contains(cmdline, []byte("-incoming")) {
		t.Fatalf("the restarted QEMU's command line has -incoming (%v): %q", err, cmdline)
	}
	if !strings.Contains(vm.Stderr(), "starting QEMU cold") {
		t.Errorf("the cold start is not in QEMU's log:\n%s", vm.Stderr())
	}
	qemuArgv := vm.Args()[len(launch("cold")):]
	vm.Kill()
	<-vm.Done()

	// 4. --on-restart fail: a clear error, and QEMU never starts.
	cmd := exec.Command(bin, append(launch("fail")[1:], qemuArgv...)...)
	out, err := cmd.CombinedOutput()
	var exitErr *exec.ExitError
	if !errors.As(err, &exitErr) || exitErr.ExitCode() != errcode.InvalidInput.ExitStatus() ||
		!strings.Contains(string(out), "loaded in this pod before") || !strings.Contains(string(out), loaded) {
		t.Fatalf("--on-restart fail: %v\n%s", err, out)
	}
	t.Logf("--on-restart fail: %s", strings.TrimSpace(string(out)))

	// 5. The -incoming defer variant: the disk alone before QEMU starts,
	// the state loaded into the waiting QEMU (as the agent does), then a
	// restart boots cold.
	tdir = targetDir(t, srcDir)
	markers, overlay = filepath.Join(tdir, "markers"), filepath.Join(tdir, "overlay.qcow2")
	if err := os.Mkdir(markers, 0o755); err != nil {
		t.Fatal(err)
	}
	cliJSON[api.RestoreResult](t, "restore", "--disk-image", cp.Disk.Image, "--disk", overlay, "--marker-dir", markers)
	startDefer := func() *guest.VM {
		return guest.Start(t, guest.Options{Disk: overlay, Dir: tdir,
			Launcher: []string{bin, "launch", "--defer", "--marker-dir", markers, "--"}})
	}
	vm = startDefer()
	if st := runState(t, vm); st != "inmigrate" {
		t.Fatalf("the first --defer start is %q, want waiting for its state (inmigrate)", st)
	}
	cliJSON[api.RestoreResult](t, "restore", "--qmp", vm.QMPPath(), "--image", cp.VMState.Image)
	assertResumed(t, vm, before, resume, resume)
	vm.Kill()
	<-vm.Done()
	vm = startDefer()
	if ready, err := vm.WaitReady(waitCtx(t)); err != nil || ready.Boot == before.Boot {
		t.Fatalf("the restarted --defer QEMU did not boot cold: %+v, %v\n%s", ready, err, vm.Stderr())
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
