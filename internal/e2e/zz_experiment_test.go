package e2e

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/testguest"
)

func TestZZExperimentFdsetAfterPause(t *testing.T) {
	root := testguest.QEMU10(t)
	testguest.Assets(t)
	dir := testguest.FreeShortDir(t)
	overlay := testguest.NewDisk(t, dir)
	src := testguest.Start(t, testguest.Options{Disk: overlay, Dir: dir, QEMURoot: root, MemMB: 256, GuestMemMB: 32})
	if _, err := src.WaitReady(waitCtx(t)); err != nil {
		t.Fatal(err)
	}
	store := filepath.Join(t.TempDir(), "store")
	staging := t.TempDir()
	for _, mode := range []string{"snapshot", "pause"} {
		cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", "oci:"+store+":"+mode, "--mode", mode, "--staging-dir", staging, "--format", "mapped-ram")
		t.Logf("%s: running %v", mode, cp.VMRunning)
		pid := src.Process().Pid
		ents, _ := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/fd")
		for _, e := range ents {
			l, _ := os.Readlink("/proc/" + strconv.Itoa(pid) + "/fd/" + e.Name())
			t.Logf("%s fd %s -> %s", mode, e.Name(), l)
			if filepath.Dir(l) == staging {
				fi, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/fdinfo/" + e.Name())
				t.Logf("%s: QEMU holds fd %s -> %s\n%s", mode, e.Name(), l, fi)
			}
		}
	}
}
