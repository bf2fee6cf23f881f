package e2e

import (
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
)

// pausedCopy starts a QEMU with opts (the source's device set) waiting
// with -incoming defer and restores image into it, left paused: a copy of
// the VM whose guest has not run one instruction since image was taken,
// so its memory is the image's, byte for byte. The tests that checkpoint
// an unchanged VM twice take the second checkpoint of such a copy: QEMU
// will not migrate a VM a migration left stopped, and running the source
// again to get it out of that state (cont, stop) lets the guest write to
// memory for as long as the machine's load keeps QEMU from the stop.
func pausedCopy(t *testing.T, reg *registry.Registry, opts guest.Options, image string, restoreArgs ...string) *guest.VM {
	t.Helper()
	opts.Incoming = true
	vm := guest.Start(t, opts)
	args := with([]string{"restore", "--qmp", vm.QMPPath(), "--image", image, "--paused"}, restoreArgs...)
	if rs := cliJSON[api.RestoreResult](t, with(args, regArgs(reg)...)...); rs.VMState == nil || rs.VMState.VMRunning {
		t.Fatalf("restore --paused: %+v", rs)
	}
	if st := runState(t, vm); st != "paused" {
		t.Fatalf("the restored copy is %s, want paused", st)
	}
	return vm
}
