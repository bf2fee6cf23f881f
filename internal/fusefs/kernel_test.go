package fusefs

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// TestBlockedReadDoesNotHoldUpOthers: a Read that waits (the lazy filler's
// case) holds one worker; other files read, a directory lists and a stat
// answers meanwhile, and the waiting reader gets the right bytes when the
// Read goes on.
func TestBlockedReadDoesNotHoldUpOthers(t *testing.T) {
	tree, _ := newTestTree(t)
	pending, release := make(chan int64, 16), make(chan struct{})
	tree.block = func(ctx context.Context, off int64) error {
		pending <- off
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	m := mountTree(t, tree, nil)
	want := make([]byte, 64<<10)
	tree.ram.ReadAt(want, 0)
	blocked := startReader(t, m.file("ram"), 0, len(want))
	<-pending

	if got, want := fileSum(t, m.file("other")), fileSum(t, tree.other.Name()); got != want {
		t.Errorf("other read %s while ram was blocked, want %s", got, want)
	}
	names, err := os.ReadDir(filepath.Dir(m.file("ram")))
	if err != nil || len(names) != 2 || names[0].Name() != "other" || names[1].Name() != "ram" {
		t.Errorf("readdir while ram was blocked: %v %v", names, err)
	}
	if fi, err := os.Stat(m.file("ram")); err != nil || fi.Size() != fileSize || fi.Mode() != 0o444 {
		t.Errorf("stat while ram was blocked: %v %v", fi, err)
	}
	if got, done := poll(blocked); done {
		t.Fatalf("the blocked reader finished (%q) before its Read went on", got)
	}
	close(release)
	if got := await(t, blocked, "the blocked reader"); got != shortSum(want) {
		t.Fatalf("the blocked reader read %q, want %q", got, shortSum(want))
	}
}

// TestInterruptCancelsTheRead: a reader killed while its Read waits makes
// the kernel send INTERRUPT; the Read's context ends with that cause, and
// the reader is let go (without the INTERRUPT it would wait for ever).
func TestInterruptCancelsTheRead(t *testing.T) {
	tree, _ := newTestTree(t)
	pending, causes := make(chan int64, 16), make(chan string, 16)
	tree.block = func(ctx context.Context, off int64) error {
		pending <- off
		<-ctx.Done()
		causes <- fmtErr(context.Cause(ctx))
		return ctx.Err()
	}
	m := mountTree(t, tree, nil)
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), envChild+"=reader", envArg+"="+m.file("ram")+" 0 4096 direct")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	<-pending
	cmd.Process.Kill()
	exited := make(chan string, 1)
	go func() { exited <- fmtErr(cmd.Wait()) }()
	await(t, exited, "the killed reader")
	if cause := await(t, causes, "the Read's end"); cause != errInterrupted.Error() {
		t.Fatalf("the Read's context ended with %v, want the interrupt", cause)
	}
}

func fmtErr(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}

// TestRootIsRootsAlone: without default_permissions the kernel leaves mode
// checks to the server. Another user is refused the root (0700), but opens a
// file for writing through a bind of its publication directory (QEMU 7.2 as
// a non-root user in a pod) and reads it.
func TestRootIsRootsAlone(t *testing.T) {
	tree, _ := newTestTree(t)
	m := mountTree(t, tree, nil)
	bind := filepath.Join(t.TempDir(), "pub")
	if err := os.Mkdir(bind, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(filepath.Dir(m.file("ram")), bind, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(bind, unix.MNT_DETACH) })
	for _, dir := range []string{m.dir, bind} { // let the other user walk to them
		for d := filepath.Dir(dir); d != "/" && strings.HasPrefix(d, os.TempDir()); d = filepath.Dir(d) {
			os.Chmod(d, 0o755)
		}
	}
	nobody := func(script string) (string, error) {
		cmd := exec.Command("/bin/sh", "-c", script)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	if out, err := nobody("ls " + m.dir); err == nil || !strings.Contains(out, "Permission denied") {
		t.Errorf("another user listed the root: %q %v", out, err)
	}
	if out, err := nobody("cat " + m.file("ram") + " >/dev/null"); err == nil || !strings.Contains(out, "Permission denied") {
		t.Errorf("another user read through the root: %q %v", out, err)
	}
	out, err := nobody("exec 3<>" + filepath.Join(bind, "ram") + " && sha256sum <&3")
	want := fileSum(t, tree.ram.Name())
	if err != nil || !strings.HasPrefix(out, fullSum(t, tree.ram.Name())) {
		t.Errorf("another user's O_RDWR open and read through the bind: %q %v, want %s", out, err, want)
	}
}
