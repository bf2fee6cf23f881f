package e2e

// Clones that are not twins: a guest with QEMU's vmgenid device, restored
// twice from one snapshot, reads different bytes from /dev/urandom right
// after resume; without the device, its clones read the same bytes.

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

var vmgenidArgs = []string{"-device", "vmgenid,guid=auto"}

func TestE2EVMGenIDClonesDiverge(t *testing.T) {
	for _, q := range []struct {
		name string
		root func(testing.TB) string
	}{
		{"qemu7.2", func(testing.TB) string { return "" }},
		{"qemu10", guest.QEMU10},
	} {
		t.Run(q.name, func(t *testing.T) {
			root := q.root(t)
			t.Run("with-vmgenid", func(t *testing.T) {
				t.Parallel()
				testClonesWithVMGenID(t, root)
			})
			t.Run("without-vmgenid", func(t *testing.T) {
				t.Parallel()
				testClonesWithoutVMGenID(t, root)
			})
		})
	}
}

// cloneSource boots a generic-kernel guest (the cloud kernel has no
// vmgenid driver), with the vmgenid device or without.
func cloneSource(t *testing.T, root string, vmgenid bool) (*guest.VM, guest.Options) {
	t.Helper()
	guest.KernelAssets(t, guest.KernelGeneric)
	opts := guest.Options{Dir: guest.FreeShortDir(t), QEMURoot: root, Kernel: guest.KernelGeneric}
	if vmgenid {
		opts.ExtraArgs = vmgenidArgs
	}
	src := guest.Start(t, opts)
	if _, err := src.WaitReady(waitCtx(t)); err != nil {
		t.Fatalf("guest did not boot: %v\n%s", err, src.SerialTail(20))
	}
	if st, err := src.WaitStatus(waitCtx(t), func(guest.Status) bool { return true }); err != nil || len(st.Rand) != 64 {
		t.Fatalf("the guest prints no 32 random bytes (rebuild it: testdata/guest/init): %v, %q", err, st.Line)
	}
	return src, opts
}

// restoreClone restores image into a new QEMU started like the source and
// returns the restore's result and the clone's first status line.
func restoreClone(t *testing.T, opts guest.Options, image string, resume int) (*api.RestoredState, guest.Status) {
	t.Helper()
	opts.Incoming, opts.Dir = true, guest.FreeShortDir(t)
	target := guest.Start(t, opts)
	rs := cliJSON[api.RestoreResult](t, "restore", "--qmp", target.QMPPath(), "--image", image)
	st, err := target.WaitStatus(waitCtx(t), func(guest.Status) bool { return true })
	if err != nil {
		t.Fatalf("clone printed no status: %v\n%s", err, target.SerialTail(10))
	}
	if st.Counter != resume || len(st.Rand) != 64 {
		t.Fatalf("clone's first line %q: want counter %d (right after resume) and 32 random bytes", st.Line, resume)
	}
	target.Kill()
	return rs.VMState, st
}

// checkpointForClones checkpoints src once it has printed another line and
// returns the image and the counter its clones resume at; src runs on.
func checkpointForClones(t *testing.T, src *guest.VM, image string) (string, int) {
	t.Helper()
	last, _ := src.LastStatus()
	if _, err := src.WaitStatus(waitCtx(t), func(s guest.Status) bool { return s.Counter > last.Counter }); err != nil {
		t.Fatal(err)
	}
	// Pause mode leaves src stopped, its log as the stream was taken, so
	// ResumeCounter is exact; then it runs on for the next snapshot.
	cp := cliJSON[api.CheckpointResult](t, "checkpoint", "--qmp", src.QMPPath(), "--image", image, "--mode", "pause")
	resume := src.ResumeCounter()
	if _, err := src.QMP(waitCtx(t), "cont", nil); err != nil {
		t.Fatal(err)
	}
	return cp.VMState.Image, resume
}

func testClonesWithVMGenID(t *testing.T, root string) {
	src, opts := cloneSource(t, root, true)
	image, resume := checkpointForClones(t, src, "oci:"+filepath.Join(t.TempDir(), "store")+":vm")
	genID := generationID(t, src)

	ins := cliJSON[snapshot.InspectResult](t, "inspect", image)
	if ins.VMState == nil || ins.VMState.Record.VMGenID != genID {
		t.Fatalf("inspect --json: the record's vmGenID is not the source's %s: %+v", genID, ins.VMState)
	}
	if out, code := cli(t, "inspect", image); code != 0 || !strings.Contains(string(out), "vmgenid: yes") {
		t.Fatalf("inspect does not say the snapshot has vmgenid (exit %d):\n%s", code, out)
	}

	// A target without the device, or with the source's own ID (a fixed
	// guid= copied from its command line), is refused before it is fed.
	for _, args := range [][]string{nil, {"-device", "vmgenid,guid=" + genID}} {
		twin := opts
		twin.ExtraArgs, twin.Incoming, twin.Dir = args, true, guest.FreeShortDir(t)
		target := guest.Start(t, twin)
		doc := cliError(t, errcode.CompatMismatch, "restore", "--qmp", target.QMPPath(), "--image", image)
		if !strings.Contains(strings.Join(doc.Error.Details, "\n"), "-device vmgenid,guid=auto") {
			t.Fatalf("target %v: the refusal does not say to start it with -device vmgenid,guid=auto: %+v", args, doc.Error)
		}
		target.Kill()
	}

	r1, c1 := restoreClone(t, opts, image, resume)
	r2, c2 := restoreClone(t, opts, image, resume)
	t.Logf("with vmgenid: clone 1 rand=%s (ID %s), clone 2 rand=%s (ID %s)", c1.Rand, r1.GenerationID, c2.Rand, r2.GenerationID)
	if r1.GenerationID == "" || r1.GenerationID == r2.GenerationID || r1.GenerationID == genID || r2.GenerationID == genID {
		t.Errorf("generation IDs: source %s, clones %q and %q: want two fresh ones", genID, r1.GenerationID, r2.GenerationID)
	}
	if c1.Rand == c2.Rand {
		t.Errorf("two clones of a vmgenid snapshot read the same bytes from /dev/urandom right after resume: %s", c1.Rand)
	}
	if c1.Boot != c2.Boot || c1.Mem != c1.Mem0 || c2.Mem != c2.Mem0 {
		t.Errorf("the clones did not resume the source's guest: %s / %s", c1, c2)
	}
}

// Without the device the clones are twins: the same bytes from
// /dev/urandom. The guest kernel reseeds on a timer too (every uptime/2
// seconds early on), with entropy that differs between clones: a snapshot
// taken just before such a reseed gives clones that differ anyway. So
// twins must show up in one of a few snapshots, taken a few seconds apart.
func testClonesWithoutVMGenID(t *testing.T, root string) {
	src, opts := cloneSource(t, root, false)
	store := "oci:" + filepath.Join(t.TempDir(), "store") + ":vm"
	for attempt := 1; attempt <= 3; attempt++ {
		image, resume := checkpointForClones(t, src, store)
		if attempt == 1 {
			if out, code := cli(t, "inspect", image); code != 0 || !strings.Contains(string(out), "vmgenid: no") {
				t.Fatalf("inspect does not say the snapshot lacks vmgenid (exit %d):\n%s", code, out)
			}
			// A target with the device loads a snapshot of a VM without
			// one (Compare lets it): the guest resumes.
			withDevice := opts
			withDevice.ExtraArgs = vmgenidArgs
			restoreClone(t, withDevice, image, resume)
		}
		r1, c1 := restoreClone(t, opts, image, resume)
		_, c2 := restoreClone(t, opts, image, resume)
		t.Logf("without vmgenid, snapshot %d: clone 1 rand=%s, clone 2 rand=%s", attempt, c1.Rand, c2.Rand)
		if r1.GenerationID != "" {
			t.Fatalf("a restore without vmgenid reports generation ID %s", r1.GenerationID)
		}
		if c1.Rand == c2.Rand {
			return
		}
	}
	t.Fatal("clones without vmgenid never read the same bytes: the test cannot tell twins from clones")
}

// generationID is what QEMU's query-vm-generation-id reports.
func generationID(t *testing.T, vm *guest.VM) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	raw, err := vm.QMP(ctx, "query-vm-generation-id", nil)
	if err != nil {
		t.Fatal(err)
	}
	var r struct{ GUID string }
	if err := json.Unmarshal(raw, &r); err != nil {
		t.Fatal(err)
	}
	return strings.ToLower(r.GUID)
}
