package fusefs

import (
	"bytes"
	"context"
	"errors"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// TestInvalidateInode: the kernel keeps a file's pages across opens
// (KEEP_CACHE) even when the bytes behind them change, until the server
// invalidates them.
func TestInvalidateInode(t *testing.T) {
	tree, _ := newTestTree(t)
	m := mountTree(t, tree, nil)
	before, err := os.ReadFile(m.file("ram"))
	if err != nil {
		t.Fatal(err)
	}
	changed := bytes.Repeat([]byte{0xA5}, fileSize)
	if err := os.WriteFile(tree.ram.Name(), changed, 0o600); err != nil {
		t.Fatal(err)
	}
	if got := fileSum(t, m.file("ram")); got != shortSum(before) {
		t.Fatalf("a second open read %s, want the cached %s", got, shortSum(before))
	}
	if err := m.conn.InvalidateInode(nodeRAM, 0, 0); err != nil {
		t.Fatal(err)
	}
	if got := fileSum(t, m.file("ram")); got != shortSum(changed) {
		t.Fatalf("after the invalidation the file reads %s, want %s", got, shortSum(changed))
	}
	if err := m.conn.InvalidateInode(12345, 0, 0); err != nil {
		t.Errorf("invalidating a node the kernel does not hold: %v", err)
	}
}

// TestAbort: Abort ends the connection through fusectl (mounting it when
// the host has not): the mount answers ENOTCONN and Serve returns.
func TestAbort(t *testing.T) {
	requireFUSE(t)
	tree, _ := newTestTree(t)
	dir := t.TempDir()
	fd, err := Mount(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { Unmount(dir); unix.Close(fd) })
	conn, err := Accept(context.Background(), fd)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan string, 1)
	go func() { served <- fmtErr(conn.Serve(context.Background(), tree)) }()
	if _, err := os.Stat(dir + "/p/vol/ram"); err != nil {
		t.Fatal(err)
	}
	if err := Abort(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir + "/p/vol/other"); !errors.Is(err, unix.ENOTCONN) {
		t.Errorf("stat after the abort: %v, want ENOTCONN", err)
	}
	if got := await(t, served, "Serve after the abort"); got != "<nil>" {
		t.Errorf("Serve returned %s after the abort, want nil", got)
	}
}
