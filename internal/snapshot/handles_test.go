package snapshot

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/vmsnap/vmsnap/internal/beneath"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// TestRestoreUsesTheGivenHandles: a restore given the VM's handles (as the
// agent's resolver opens them) dials that descriptor, never its QMPPath,
// which only names the socket, and leaves the descriptor open for its
// caller, as a checkpoint does.
func TestRestoreUsesTheGivenHandles(t *testing.T) {
	ctx := context.Background()
	state := randomState(t, 1<<20)
	src := qmptest.NewFakeQEMU(t, "running", state)
	cp, err := Checkpoint(ctx, CheckpointSpec{QMPPath: src.Path(), Image: "oci:" + t.TempDir() + ":vm", Mode: "snapshot"})
	if err != nil {
		t.Fatal(err)
	}
	target := qmptest.NewFakeQEMU(t, "inmigrate", state)
	q, err := beneath.Path(target.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	nowhere := filepath.Join(t.TempDir(), "qmp.sock") // no socket here
	res, err := RestoreState(ctx, RestoreSpec{QMPPath: nowhere, Handles: &Handles{QMP: q}, Image: cp.VMState.Image})
	if err != nil || !bytes.Equal(received(target), state) || res.VMState.Digest != cp.VMState.Digest {
		t.Fatalf("restore through the given handle: %+v, %v", res, err)
	}
	if _, err := q.Stat(); err != nil {
		t.Fatalf("the restore closed its caller's handle: %v", err)
	}
	// Without handles, the same path is the caller's own: nothing there.
	if _, err := RestoreState(ctx, RestoreSpec{QMPPath: nowhere, Image: cp.VMState.Image}); errcode.Of(err) != errcode.VMNotFound {
		t.Fatalf("restore at a path with no socket: %v, want VM_NOT_FOUND", err)
	}
}

// TestHandlesMustMatchTheirPaths: handles that do not stand for the
// operation's paths (no QMP socket; a disk without a disk path, or the
// other way round) are refused as the caller's bug, before anything is
// dialed.
func TestHandlesMustMatchTheirPaths(t *testing.T) {
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, c := range []struct {
		what     string
		given    *Handles
		diskPath string
		want     string
	}{
		{"restore", &Handles{}, "", "the restore's opened files do not match its QMP socket and disk paths"},
		{"restore", &Handles{QMP: f, Disk: f}, "", "the restore's opened files do not match its QMP socket and disk paths"},
		{"checkpoint", &Handles{QMP: f}, "/vm/disk.qcow2", "the checkpoint's opened files do not match its QMP socket and disk paths"},
	} {
		if _, _, err := handlesFor(c.what, c.given, "/vm/qmp.sock", c.diskPath); errcode.Of(err) != errcode.Internal || err.Error() != c.want {
			t.Errorf("%s with %+v: %v, want INTERNAL %q", c.what, c.given, err, c.want)
		}
	}
}
