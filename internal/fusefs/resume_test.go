package fusefs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// stallFrom: the killable server's Reads of ram at or past it never finish.
const stallFrom = 2 << 20

// killableServer is a child that mounts at DIR, gives a dup of its /dev/fuse
// descriptor and its INIT state to the holder at SOCK (arg "DIR SOCK
// TREEDIR"), and serves the test tree; a Read of ram past stallFrom prints
// "pending OFF" and waits for ever.
func killableServer(arg string) error {
	var dir, sock, treeDir string
	if _, err := fmt.Sscan(arg, &dir, &sock, &treeDir); err != nil {
		return fmt.Errorf("server: want DIR SOCK TREEDIR: %w", err)
	}
	tree, err := openTestTree(treeDir)
	if err != nil {
		return err
	}
	tree.block = func(ctx context.Context, off int64) error {
		if off < stallFrom {
			return nil
		}
		fmt.Println("pending", off)
		<-ctx.Done()
		return ctx.Err()
	}
	fd, err := Mount(dir)
	if err != nil {
		return err
	}
	conn, err := Accept(context.Background(), fd)
	if err != nil {
		return err
	}
	if err := giveFd(sock, fd, conn.State()); err != nil {
		return err
	}
	return conn.Serve(context.Background(), tree)
}

// giveFd sends fd and the state beside it over a unix socket (SCM_RIGHTS),
// as the agent hands its descriptor to the mounter that keeps it.
func giveFd(sock string, fd int, st State) error {
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return err
	}
	defer c.Close()
	msg, err := json.Marshal(st)
	if err != nil {
		return err
	}
	_, _, err = c.WriteMsgUnix(msg, unix.UnixRights(fd), nil)
	return err
}

// holdFd accepts one giveFd on l and returns the descriptor and state.
func holdFd(t *testing.T, l *net.UnixListener) (int, State) {
	t.Helper()
	c, err := l.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	msg, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := c.ReadMsgUnix(msg, oob)
	if err != nil {
		t.Fatal(err)
	}
	var st State
	if err := json.Unmarshal(msg[:n], &st); err != nil {
		t.Fatal(err)
	}
	cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(cmsgs) != 1 {
		t.Fatalf("no descriptor came with the state: %v", err)
	}
	fds, err := unix.ParseUnixRights(&cmsgs[0])
	if err != nil || len(fds) != 1 {
		t.Fatalf("no descriptor came with the state: %v", err)
	}
	return fds[0], st
}

// killed is what the resume tests start from: a server child SIGKILLed
// while a reader child waits for a READ it had read, and the holder (this
// process) keeping a dup of the descriptor and the INIT state.
type killed struct {
	fd         int
	st         State
	m          *mounted
	tree       *testTree
	readerDone <-chan string // the reader's output when it exits
	want       string        // what it must print
}

func killServerWithPendingRead(t *testing.T) killed {
	requireFUSE(t)
	tree, treeDir := newTestTree(t)
	k := killed{m: &mounted{dir: t.TempDir()}, tree: tree}
	sock := filepath.Join(t.TempDir(), "holder.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	server, _, serverOut := child(t, "server", strings.Join([]string{k.m.dir, sock, treeDir}, " "))
	k.fd, k.st = holdFd(t, l)
	t.Cleanup(func() { Unmount(k.m.dir); unix.Close(k.fd) })

	off, n := int64(stallFrom+4096), 64<<10
	b := make([]byte, n)
	if _, err := tree.ram.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	k.want = shortSum(b)
	k.readerDone = startReader(t, k.m.file("ram"), off, n)
	if got := line(t, serverOut); !strings.HasPrefix(got, "pending ") {
		t.Fatalf("the server printed %q, want pending OFF", got)
	}
	if err := server.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	server.Wait()
	if got, done := poll(k.readerDone); done {
		t.Fatalf("the reader finished (%q) with its server dead", got)
	}
	return k
}

// startReader starts a reader child of n bytes at off of path; the channel
// gets what it printed (or its error) when it exits.
func startReader(t *testing.T, path string, off int64, n int) <-chan string {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), envChild+"=reader", fmt.Sprintf("%s=%s %d %d", envArg, path, off, n))
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan string, 1)
	go func() {
		if err := cmd.Wait(); err != nil {
			done <- fmt.Sprintf("reader failed: %v", err)
			return
		}
		done <- strings.TrimSpace(out.String())
	}()
	t.Cleanup(func() { cmd.Process.Kill() })
	return done
}

// poll says whether ch has a value, without waiting.
func poll(ch <-chan string) (string, bool) {
	select {
	case s := <-ch:
		return s, true
	default:
		return "", false
	}
}

// await waits for ch, failing (not hanging) if the wait is absurdly long.
func await(t *testing.T, ch <-chan string, what string) string {
	t.Helper()
	select {
	case s := <-ch:
		return s
	case <-time.After(2 * time.Minute):
		t.Fatalf("%s: still blocked after 2 minutes", what)
		return ""
	}
}

// serveUntilCleanup serves conn with tree until the test ends.
func serveUntilCleanup(t *testing.T, conn *Conn, tree Tree) {
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- conn.Serve(ctx, tree) }()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("Serve: %v", err)
		}
	})
}

// TestResumeAnswersWhatAKilledServerHadRead: a server is SIGKILLed with a
// READ it had read; a new server that resumes the descriptor kept by the
// holder has the kernel send it again, and the blocked reader gets the
// right bytes.
func TestResumeAnswersWhatAKilledServerHadRead(t *testing.T) {
	k := killServerWithPendingRead(t)
	conn, err := Resume(k.fd, k.st)
	if err != nil {
		t.Fatal(err)
	}
	if !conn.Resent() {
		t.Fatalf("Resume did not send FUSE_NOTIFY_RESEND on this kernel (state %+v)", k.st)
	}
	serveUntilCleanup(t, conn, k.tree)
	if got := await(t, k.readerDone, "the reader"); got != k.want {
		t.Fatalf("the reader read %q, want %q", got, k.want)
	}
}

// TestWithoutResendTheReadStaysBlocked shows what RESEND is for: a server
// resumed on a kernel without it (Resume told so by the state) serves new
// reads, while the dead server's read stays blocked until a RESEND.
func TestWithoutResendTheReadStaysBlocked(t *testing.T) {
	k := killServerWithPendingRead(t)
	st := k.st
	st.KernelFlags &^= initHasResend
	conn, err := Resume(k.fd, st)
	if err != nil {
		t.Fatal(err)
	}
	if conn.Resent() || st.ResendSupported() {
		t.Fatal("Resume says it resent on a kernel that cannot")
	}
	serveUntilCleanup(t, conn, k.tree)
	b := make([]byte, 4096)
	k.tree.other.ReadAt(b, 1<<20)
	if got := await(t, startReader(t, k.m.file("other"), 1<<20, 4096), "a new reader"); got != shortSum(b) {
		t.Fatalf("a new reader read %q, want %q", got, shortSum(b))
	}
	if got, done := poll(k.readerDone); done {
		t.Fatalf("the dead server's read finished (%q) with no RESEND", got)
	}
	if err := conn.Resend(); err != nil {
		t.Fatal(err)
	}
	if got := await(t, k.readerDone, "the reader after RESEND"); got != k.want {
		t.Fatalf("the reader read %q, want %q", got, k.want)
	}
}
