// Package containerd runs a real containerd for tests: Debian's
// containerd (1.6) and runc, started as root with a configuration of its own
// (root, state and gRPC socket under a short temporary directory, the CRI
// plugin disabled), so that code which talks to a node's containerd can be
// tested against the real thing rather than a fake.
//
// It can create containers the way the kubelet's CRI plugin would label them
// (io.kubernetes.pod.uid, io.kubernetes.container.name, ...), with a bind
// mount from a host directory, start their tasks, delete them and replace
// them with a new container of the same pod.
//
// Everything it starts is stopped on t.Cleanup: tasks are killed, containers
// deleted, containerd terminated, and any shim still running for this
// daemon is killed. containerd is started with a parent-death signal, so it
// dies with the test binary; a test binary killed outright (go test's
// -timeout, SIGKILL) can still leave shims and their containers behind, and
// the next Start removes them.
//
// Tests that need it call Start. Without root, containerd, runc or
// busybox-static, Start skips the test with a loud reason, unless
// VMSNAP_TEST_REQUIRE_QEMU=1 (CI), where it fails instead. In -short mode it
// always skips.
//
// It is a test helper only: nothing outside _test.go files may import it.
package containerd

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"

	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

// Namespace is the containerd namespace the harness uses: the one the
// kubelet's CRI plugin uses.
const Namespace = "k8s.io"

// Snapshotter is the snapshotter containers are created with.
const Snapshotter = "overlayfs"

// dirPrefix starts the name of every daemon's directory under /tmp. It is
// short on purpose: unix socket paths are limited to 108 bytes.
const dirPrefix = "vmsnap-ctrd-"

// Daemon is a running containerd.
type Daemon struct {
	// Address is the containerd gRPC socket.
	Address string
	// Dir holds the daemon's root, state, socket, log and runc root.
	Dir string
	// Client is connected to the daemon with Namespace as its default.
	Client *client.Client

	runcRoot string
	runcBin  string
	fifoDir  string
	logPath  string
	cmd      *exec.Cmd
	exited   chan struct{}
	lock     *os.File

	imageOnce sync.Once
	image     client.Image
	imageErr  error

	mu         sync.Mutex
	containers map[string]*Container // live containers by ID

	cri string // the CRI plugin's configuration; "": the plugin is disabled
}

// Missing returns why a real containerd cannot be run here, or "" if it
// can: not root, or a needed program is not installed.
func Missing() string {
	var why []string
	if os.Geteuid() != 0 {
		why = append(why, "not running as root")
	}
	for _, bin := range []string{"containerd", "containerd-shim-runc-v2", "runc"} {
		if _, err := lookPath(bin); err != nil {
			why = append(why, bin+" not found")
		}
	}
	if _, err := os.Stat(busyboxPath); err != nil {
		why = append(why, busyboxPath+" not found")
	}
	if len(why) == 0 {
		return ""
	}
	return strings.Join(why, ", ") + " (apt-get install -y containerd runc busybox-static, and run as root)"
}

// Require skips the test (or fails it, when VMSNAP_TEST_REQUIRE_QEMU=1) if a
// real containerd cannot be run here. Start calls it.
func Require(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("SKIPPING: real containerd test in -short mode")
	}
	if why := Missing(); why != "" {
		guest.SkipOrFail(t, "real containerd", why)
	}
}

// lookPath finds a program also in the sbin directories, which a non-login
// root shell may not have on PATH (Debian's runc is /usr/sbin/runc).
func lookPath(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, d := range []string{"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"} {
		p := filepath.Join(d, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s: not found", name)
}

// Start starts a containerd for this test and stops it on t.Cleanup.
func Start(t testing.TB) *Daemon { t.Helper(); return start(t, nil) }

// StartCRI starts a containerd with its CRI plugin enabled, for a kubelet:
// cri returns the plugin's TOML table ([plugins."io.containerd.grpc.v1.cri"]
// and its sub-tables) for the daemon's directory. The runc root must be
// RuncRoot(dir), so that cleanup finds the pods' containers.
func StartCRI(t testing.TB, cri func(dir string) string) *Daemon {
	t.Helper()
	return start(t, cri)
}

// RuncRoot is where the daemon whose directory is dir keeps runc's state.
func RuncRoot(dir string) string { return filepath.Join(dir, "runc") }

func start(t testing.TB, cri func(dir string) string) *Daemon {
	t.Helper()
	Require(t)
	reapStale(t)

	dir, err := os.MkdirTemp("/tmp", dirPrefix)
	if err != nil {
		t.Fatal(err)
	}
	// The lock tells reapStale of other test binaries that this daemon is
	// alive: it is released when this process dies, however it dies. The fd
	// is close-on-exec, so containerd and its shims do not hold it.
	// It is locked under another name and then renamed, so that no other
	// binary ever sees it unlocked.
	lock, err := os.OpenFile(filepath.Join(dir, "lock.new"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "lock.new"), filepath.Join(dir, "lock")); err != nil {
		t.Fatal(err)
	}
	runcBin, err := lookPath("runc")
	if err != nil {
		t.Fatal(err)
	}
	d := &Daemon{
		Address:    filepath.Join(dir, "c.sock"),
		Dir:        dir,
		runcRoot:   RuncRoot(dir),
		runcBin:    runcBin,
		fifoDir:    filepath.Join(dir, "fifo"),
		logPath:    filepath.Join(dir, "containerd.log"),
		lock:       lock,
		containers: map[string]*Container{},
	}
	if cri != nil {
		d.cri = cri(dir)
	}
	t.Cleanup(func() { d.stop(t) })
	if err := d.start(); err != nil {
		t.Fatalf("starting containerd: %v\n%s", err, d.logTail())
	}
	return d
}

func (d *Daemon) config() string {
	// Plugins a test does not need are disabled: the CRI plugin above all,
	// unless a kubelet is to use it (it wants CNI and the kubelet's view of
	// the world), the snapshotters
	// other than overlayfs and native, tracing and the /opt installer (which
	// would create /opt/containerd). The v1 runtime stays: 1.6's tasks
	// service refuses to load without it.
	disabledCRI := `"io.containerd.grpc.v1.cri",`
	if d.cri != "" {
		disabledCRI = ""
	}
	return fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = [
  %s
  "io.containerd.internal.v1.opt",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = %q

[ttrpc]
  address = %q

[debug]
  address = ""
  level = "info"

[metrics]
  address = ""

%s
`, filepath.Join(d.Dir, "root"), filepath.Join(d.Dir, "state"), disabledCRI, d.Address, d.Address+".ttrpc", d.cri)
}

func (d *Daemon) start() error {
	bin, err := lookPath("containerd")
	if err != nil {
		return err
	}
	cfg := filepath.Join(d.Dir, "config.toml")
	if err := os.WriteFile(cfg, []byte(d.config()), 0o600); err != nil {
		return err
	}
	logf, err := os.Create(d.logPath)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(bin, "--config", cfg)
	cmd.Stdout, cmd.Stderr = logf, logf
	// containerd finds its shim on PATH, and the shim finds runc there.
	cmd.Env = append(os.Environ(), "PATH="+os.Getenv("PATH")+":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	d.cmd = cmd
	os.WriteFile(filepath.Join(d.Dir, "containerd.pid"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o600)
	exited := make(chan struct{})
	d.exited = exited
	go func() { cmd.Wait(); close(exited) }()

	if d.Client == nil {
		c, err := client.New(d.Address, client.WithDefaultNamespace(Namespace),
			client.WithDefaultRuntime("io.containerd.runc.v2"), client.WithTimeout(5*time.Second))
		if err != nil {
			return err
		}
		d.Client = c
	}
	c := d.Client
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		if _, err := os.Stat(d.Address); err == nil {
			vctx, vcancel := context.WithTimeout(ctx, 2*time.Second)
			_, err = c.Version(vctx)
			vcancel()
			if err == nil {
				return nil
			}
		}
		select {
		case <-exited:
			return fmt.Errorf("containerd exited: %v", cmd.ProcessState)
		case <-ctx.Done():
			return errors.New("containerd did not answer within 30s")
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (d *Daemon) logTail() string {
	b, _ := os.ReadFile(d.logPath)
	if len(b) > 8000 {
		b = b[len(b)-8000:]
	}
	return "containerd log (tail):\n" + string(b)
}

// Log writes the tail of containerd's log to the test log.
func (d *Daemon) Log(t testing.TB) { t.Helper(); t.Log(d.logTail()) }

// Restart stops containerd (SIGTERM) and starts it again with the same
// configuration, as an upgrade or a crash of a node's containerd would.
// Containers and their tasks keep running (their shims do not depend on
// containerd), and clients reconnect by themselves. down, if not nil, runs
// while containerd is stopped.
func (d *Daemon) Restart(t testing.TB, down func()) {
	t.Helper()
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
	case <-time.After(10 * time.Second):
		d.cmd.Process.Kill()
		<-d.exited
	}
	if down != nil {
		down()
	}
	if err := d.start(); err != nil {
		t.Fatalf("restarting containerd: %v\n%s", err, d.logTail())
	}
}

// stop removes every container this daemon still runs, stops containerd,
// kills leftover shims and removes the directory.
func (d *Daemon) stop(t testing.TB) {
	if d.Client != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		d.mu.Lock()
		var left []*Container
		for _, c := range d.containers {
			left = append(left, c)
		}
		d.mu.Unlock()
		for _, c := range left {
			if err := d.remove(ctx, c); err != nil {
				t.Logf("containerd: removing container %s: %v", c.ID, err)
			}
		}
		cancel()
		d.Client.Close()
	}
	if d.cmd != nil && d.cmd.Process != nil {
		d.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-d.exited:
		case <-time.After(5 * time.Second):
			d.cmd.Process.Kill()
			<-d.exited
		}
	}
	cleanupDir(t, d.Dir)
	if d.lock != nil {
		d.lock.Close()
	}
}

// reapStale cleans up after test binaries that died without their cleanup:
// every /tmp/vmsnap-ctrd-* directory whose lock is free.
func reapStale(t testing.TB) {
	dirs, _ := filepath.Glob(filepath.Join("/tmp", dirPrefix+"*"))
	for _, dir := range dirs {
		f, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_RDWR, 0)
		if err != nil {
			// No lock file: being created right now, or not ours. Leave it
			// unless it is old.
			if fi, serr := os.Stat(dir); serr != nil || time.Since(fi.ModTime()) < 10*time.Minute {
				continue
			}
		} else {
			err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
			if err != nil {
				f.Close()
				continue // alive
			}
		}
		t.Logf("containerd: cleaning up %s, left by a test binary that died", dir)
		if b, err := os.ReadFile(filepath.Join(dir, "containerd.pid")); err == nil {
			if pid, err := strconv.Atoi(string(b)); err == nil && isProcess(pid, "containerd") {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		cleanupDir(t, dir)
		if f != nil {
			f.Close()
		}
	}
}

// cleanupDir kills the shims and containers of the daemon whose directory
// is dir (containerd itself must be stopped), unmounts what is left mounted
// under it and removes it.
func cleanupDir(t testing.TB, dir string) {
	address := filepath.Join(dir, "c.sock")
	// Containers first, through runc with the daemon's own runc root, then
	// their shims. Killing a shim does not kill its container.
	runcRoot := RuncRoot(dir)
	if runc, err := lookPath("runc"); err == nil {
		states, _ := filepath.Glob(filepath.Join(runcRoot, "*", "*", "state.json"))
		for _, st := range states {
			id := filepath.Base(filepath.Dir(st))
			root := filepath.Dir(filepath.Dir(st))
			exec.Command(runc, "--root", root, "kill", id, "KILL").Run()
			exec.Command(runc, "--root", root, "delete", "--force", id).Run()
		}
	}
	pids := shimPIDs(address)
	for _, pid := range pids {
		t.Logf("containerd: killing leftover shim %d", pid)
		syscall.Kill(pid, syscall.SIGKILL)
	}
	if len(pids) > 0 {
		// A killed shim leaves its socket in the host's /run/containerd/s;
		// each bundle records where.
		addrs, _ := filepath.Glob(filepath.Join(dir, "state", "io.containerd.runtime.v2.task", "*", "*", "address"))
		for _, a := range addrs {
			if b, err := os.ReadFile(a); err == nil {
				if sock, ok := strings.CutPrefix(strings.TrimSpace(string(b)), "unix://"); ok && strings.HasPrefix(sock, "/run/containerd/s/") {
					os.Remove(sock)
				}
			}
		}
	}
	// Rootfs mounts of tasks, deepest first.
	for _, err := range UnmountAll(dir) {
		t.Logf("containerd: %v", err)
	}
	if left := mountsUnder(dir); len(left) > 0 {
		t.Logf("containerd: not removing %s: still mounted: %v", dir, left)
		return
	}
	if err := os.RemoveAll(dir); err != nil {
		t.Logf("containerd: %v", err)
	}
}

// UnmountAll detaches every mount at or under dir, deepest first, and
// returns the errors (a mount point still mounted after it is one).
func UnmountAll(dir string) []error {
	var errs []error
	mounts := mountsUnder(dir)
	for i := len(mounts) - 1; i >= 0; i-- {
		if err := syscall.Unmount(mounts[i], syscall.MNT_DETACH); err != nil {
			errs = append(errs, fmt.Errorf("unmount %s: %w", mounts[i], err))
		}
	}
	return errs
}

// shimPIDs lists the containerd-shim processes serving the daemon at
// address (their command line names it after -address).
func shimPIDs(address string) []int {
	ents, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(bytes.TrimRight(b, "\x00")), "\x00")
		if len(args) == 0 || !strings.HasPrefix(filepath.Base(args[0]), "containerd-shim") {
			continue
		}
		for i := 0; i+1 < len(args); i++ {
			if args[i] == "-address" && args[i+1] == address {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}

func isProcess(pid int, name string) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	return err == nil && strings.TrimSpace(string(b)) == name
}

// mountsUnder lists the mount points under dir in the order of mountinfo.
func mountsUnder(dir string) []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMountinfo(fields[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	return out
}

func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
