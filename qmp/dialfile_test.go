package qmp_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/beneath"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// TestDialFile: DialFile reaches the socket its descriptor was opened on,
// wherever that socket's name points now and however long its path is;
// errors name the socket as the caller does.
func TestDialFile(t *testing.T) {
	a := qmptest.NewFakeQEMU(t, "running", nil)
	b := qmptest.NewFakeQEMU(t, "running", nil)
	long := filepath.Join(t.TempDir(), strings.Repeat("d", 80), strings.Repeat("e", 40))
	if err := os.MkdirAll(long, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(long, "qmp.sock")
	if err := os.Rename(a.Path(), path); err != nil {
		t.Fatal(err)
	}
	f, err := beneath.Path(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// The name now points at another QEMU's socket: the descriptor does not.
	if err := os.Rename(b.Path(), path); err != nil {
		t.Fatal(err)
	}
	c, err := qmp.DialFile(testContext(t), f, "/vm/qmp.sock")
	if err != nil {
		t.Fatalf("DialFile on a %d-byte path: %v", len(path), err)
	}
	defer c.Close()
	if err := c.Execute(testContext(t), "stop", nil, nil); err != nil {
		t.Fatal(err)
	}
	if a.Status() != "paused" || b.Status() != "running" || len(b.Srv.Received()) != 0 {
		t.Fatalf("stopped the wrong QEMU: a %s, b %s (%d commands)", a.Status(), b.Status(), len(b.Srv.Received()))
	}

	// A socket nobody listens on any more: VM_NOT_FOUND, named as given.
	stale := filepath.Join(t.TempDir(), "stale.sock")
	srv := qmptest.NewServer(t, nil)
	if err := os.Rename(srv.Path(), stale); err != nil {
		t.Fatal(err)
	}
	g, err := beneath.Path(stale)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	srv.Close()
	_, err = qmp.DialFile(testContext(t), g, "/vm/stale.sock")
	if errcode.Of(err) != errcode.VMNotFound || !strings.Contains(err.Error(), "no QEMU is listening at /vm/stale.sock") {
		t.Fatalf("DialFile to a closed socket: %v (%s), want VM_NOT_FOUND naming /vm/stale.sock", err, errcode.Of(err))
	}
}
