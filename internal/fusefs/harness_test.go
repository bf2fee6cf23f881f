package fusefs

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

// The test binary doubles as the processes the tests need beside them (a
// victim that maps a file, an attacker, a reader, a server to kill): run
// with envChild set, it is that process instead.
const (
	envChild = "VMSNAP_FUSEFS_CHILD"
	envArg   = "VMSNAP_FUSEFS_ARG"
)

func TestMain(m *testing.M) {
	if role := os.Getenv(envChild); role != "" {
		os.Exit(runChild(role, os.Getenv(envArg)))
	}
	os.Exit(m.Run())
}

func runChild(role, arg string) int {
	var err error
	switch role {
	case "victim":
		err = victim(arg)
	case "attack":
		i := strings.LastIndexByte(arg, ' ') // "NAME PATH"; names have spaces, test paths none
		err = runAttack(arg[:max(i, 0)], arg[i+1:])
	case "reader":
		err = reader(arg)
	case "server":
		err = killableServer(arg)
	default:
		err = fmt.Errorf("unknown child role %q", role)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// child starts the test binary as role, with its stdin and stdout piped; it
// is killed when the test ends.
func child(t *testing.T, role, arg string) (*exec.Cmd, io.WriteCloser, *bufio.Reader) {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), envChild+"="+role, envArg+"="+arg)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd, in, bufio.NewReader(out)
}

// line reads one line a child printed.
func line(t *testing.T, r *bufio.Reader) string {
	t.Helper()
	s, err := r.ReadString('\n')
	if err != nil {
		t.Fatalf("reading from the child: %v (it printed %q)", err, s)
	}
	return strings.TrimSpace(s)
}

// requireFUSE skips (or fails, in CI) a test the machine cannot run.
func requireFUSE(t testing.TB) {
	t.Helper()
	if os.Getuid() != 0 {
		guest.SkipOrFail(t, "real-FUSE", "mounting FUSE needs root")
	}
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		guest.SkipOrFail(t, "real-FUSE", fmt.Sprintf("/dev/fuse: %v (modprobe fuse)", err))
	}
	unix.Close(fd)
}

// mounted is a test filesystem served by this process.
type mounted struct {
	dir  string
	fd   int
	conn *Conn
}

// file is the path of the test tree's file name.
func (m *mounted) file(name string) string { return filepath.Join(m.dir, "p", "vol", name) }

// mountTree mounts tree on a temp dir and serves it until the test ends; then
// it unmounts (detached, so a stuck test cannot hang it) and closes the
// descriptor, which aborts the connection if no one else holds it.
func mountTree(t testing.TB, tree Tree, setup func(*Conn)) *mounted {
	t.Helper()
	requireFUSE(t)
	m := &mounted{dir: t.TempDir()}
	fd, err := Mount(m.dir)
	if err != nil {
		t.Fatal(err)
	}
	m.fd = fd
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	t.Cleanup(func() {
		if err := Unmount(m.dir); err != nil {
			t.Errorf("unmount: %v", err)
		}
		cancel()
		if err := <-served; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("Serve: %v", err)
		}
		unix.Close(fd)
	})
	m.conn, err = Accept(ctx, fd)
	if err != nil {
		served <- nil
		t.Fatal(err)
	}
	if setup != nil {
		setup(m.conn)
	}
	go func() { served <- m.conn.Serve(ctx, tree) }()
	return m
}

func shortSum(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:8])
}

// fileSum hashes a file read with pread, through whatever cache it has.
func fileSum(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return shortSum(b)
}

// fullSum is the hex sha256 of a file, as sha256sum prints it.
func fullSum(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}
