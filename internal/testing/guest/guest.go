// Package guest starts real QEMU guests for vmsnap's tests.
//
// The guest is a Debian kernel (the cloud flavour, or the generic one for
// vmgenid: Options.Kernel) plus a busybox initramfs whose /init
// (testdata/guest/init) fills some RAM with random data, stamps a marker on
// its virtio disk and then prints, about once a second, one serial line
//
//	VMSNAP counter=N boot=BOOTID mem=MD5_NOW mem0=MD5_AT_BOOT disk=MARKER rand=HEX
//
// so a test can tell that a restored guest is the same boot (boot), that it
// kept running where it stopped (counter), that its memory came back intact
// (mem == mem0) and that it sees its disk (disk, read with O_DIRECT); rand is
// 32 bytes read from /dev/urandom just before the line, so that clones can
// be told apart from twins.
//
// Assets builds the kernel and initramfs once (testdata/guest/build.sh) into
// a cache; Start boots a guest under TCG; NewDisk makes a qcow2 overlay on a
// base image. When the host cannot run the guest (no QEMU, no static busybox,
// no way to fetch the kernel) the test is skipped with the reason — set
// VMSNAP_TEST_REQUIRE_QEMU=1 to turn those skips into failures (CI).
//
// Environment:
//
//	VMSNAP_TEST_CACHE         cache directory (default: os.UserCacheDir()/vmsnap-test)
//	VMSNAP_TEST_KVM=1         use -accel kvm instead of tcg
//	VMSNAP_TEST_REQUIRE_QEMU=1  fail instead of skipping when QEMU tests cannot run
//	VMSNAP_KERNEL_DEB         a kernel .deb for build.sh, or a directory of them
package guest

import (
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// Environment variables read by this package.
const (
	EnvCache        = "VMSNAP_TEST_CACHE"
	EnvKVM          = "VMSNAP_TEST_KVM"
	EnvRequireQEMU  = "VMSNAP_TEST_REQUIRE_QEMU"
	EnvKernelDeb    = "VMSNAP_KERNEL_DEB"
	envBusybox      = "VMSNAP_BUSYBOX"
	buildScriptPath = "testdata/guest/build.sh"
)

// QEMUBinary and QEMUImgBinary are the programs Start and NewDisk run.
const (
	QEMUBinary    = "qemu-system-x86_64"
	QEMUImgBinary = "qemu-img"
)

// buildTimeout bounds one run of build.sh (a kernel download included).
const buildTimeout = 5 * time.Minute

// Kernel is the guest kernel's flavour (build.sh --kernel).
type Kernel string

const (
	// KernelCloud is Debian's cloud kernel: the default, it boots fastest.
	KernelCloud Kernel = "cloud"
	// KernelGeneric is Debian's generic kernel (pinned in build.sh), built
	// with CONFIG_VMGENID: it reseeds its RNG when QEMU's vmgenid device
	// gives it a new generation ID.
	KernelGeneric Kernel = "generic"
)

// cacheSubdir is where a flavour's build lives in the test cache.
func (k Kernel) cacheSubdir() string {
	if k == KernelCloud {
		return "guest"
	}
	return "guest-" + string(k)
}

type builtAssets struct {
	once           sync.Once
	kernel, initrd string
	skip           string // the host cannot run the guest: why
	err            error  // the build itself failed
}

var assets = map[Kernel]*builtAssets{KernelCloud: {}, KernelGeneric: {}}

var skipNotices sync.Map // what -> printed

// SkipOrFail is how every test harness here treats a real part the machine
// lacks: it skips t, loudly, saying why and what to install, or fails it when
// VMSNAP_TEST_REQUIRE_QEMU is set (CI: a missing part is never a silent
// pass). what names the part ("real-QEMU", "real containerd"...).
func SkipOrFail(t testing.TB, what, reason string) {
	t.Helper()
	if os.Getenv(EnvRequireQEMU) != "" {
		t.Fatalf("%s test cannot run (%s is set): %s", what, EnvRequireQEMU, reason)
	}
	// go test hides a passing package's output; stderr at least shows up
	// with -v and in the test binary's own output.
	if _, printed := skipNotices.LoadOrStore(what, true); !printed {
		fmt.Fprintf(os.Stderr, "*** SKIP %s tests: %s\n", what, reason)
	}
	t.Skipf("SKIP %s test: %s", what, reason)
}

// skipf is SkipOrFail for the real-QEMU tests.
func skipf(t testing.TB, format string, args ...any) {
	t.Helper()
	SkipOrFail(t, "real-QEMU", fmt.Sprintf(format, args...))
}

// Assets returns the cloud guest's kernel and initramfs, building them on
// first use (once per process, serialised across processes by a file lock)
// into $VMSNAP_TEST_CACHE/guest or os.UserCacheDir()/vmsnap-test/guest. It
// skips t when the host lacks what the guest needs.
func Assets(t testing.TB) (kernel, initrd string) {
	t.Helper()
	return KernelAssets(t, KernelCloud)
}

// KernelAssets is Assets for a kernel flavour; the generic one is built
// into the cache's guest-generic directory.
func KernelAssets(t testing.TB, k Kernel) (kernel, initrd string) {
	t.Helper()
	a, ok := assets[k]
	if !ok {
		t.Fatalf("unknown guest kernel flavour %q", k)
	}
	a.once.Do(func() { a.build(k) })
	if a.skip != "" {
		skipf(t, "%s", a.skip)
	}
	if a.err != nil {
		t.Fatalf("building the %s test guest: %v", k, a.err)
	}
	return a.kernel, a.initrd
}

// CacheDir is where Assets keeps its build (and the downloaded kernel
// package): $VMSNAP_TEST_CACHE, else os.UserCacheDir()/vmsnap-test, else
// $TMPDIR/vmsnap-test-cache.
func CacheDir() (string, error) {
	if d := os.Getenv(EnvCache); d != "" {
		return filepath.Abs(d)
	}
	if d, err := os.UserCacheDir(); err == nil {
		return filepath.Join(d, "vmsnap-test"), nil
	}
	return filepath.Join(os.TempDir(), "vmsnap-test-cache"), nil
}

func (a *builtAssets) build(flavour Kernel) {
	if _, err := exec.LookPath(QEMUBinary); err != nil {
		a.skip = QEMUBinary + " not installed (apt-get install qemu-system-x86)"
		return
	}
	if reason := checkBusybox(); reason != "" {
		a.skip = reason
		return
	}
	if _, err := exec.LookPath("cpio"); err != nil {
		a.skip = "cpio not installed (apt-get install cpio)"
		return
	}
	script, err := findBuildScript()
	if err != nil {
		a.err = err
		return
	}
	cache, err := CacheDir()
	if err != nil {
		a.skip = err.Error()
		return
	}
	out := filepath.Join(cache, flavour.cacheSubdir())
	if err := os.MkdirAll(out, 0o755); err != nil {
		a.skip = fmt.Sprintf("cannot create the guest cache %s: %v", out, err)
		return
	}
	unlock, err := LockFile(filepath.Join(cache, "a.lock"))
	if err != nil {
		a.err = fmt.Errorf("locking %s: %w", cache, err)
		return
	}
	defer unlock()

	ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "sh", script, "--kernel", string(flavour), out)
	var output bytes.Buffer
	cmd.Stdout = &output
	cmd.Stderr = &output
	err = cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &exit) && exit.ExitCode() == 3:
		// build.sh: a prerequisite is missing; its message says which.
		msg := strings.TrimSpace(output.String())
		if i := strings.LastIndex(msg, "build.sh: MISSING: "); i >= 0 {
			msg = strings.TrimSpace(msg[i+len("build.sh: MISSING: "):])
		}
		a.skip = "cannot build the test guest: " + msg
		return
	default:
		a.err = fmt.Errorf("%s %s: %v\n%s", script, out, err, output.String())
		return
	}
	a.kernel = filepath.Join(out, "vmlinuz")
	a.initrd = filepath.Join(out, "initrd")
	for _, f := range []string{a.kernel, a.initrd} {
		if _, err := os.Stat(f); err != nil {
			a.err = fmt.Errorf("%s succeeded but %v", script, err)
			return
		}
	}
}

// checkBusybox returns why the host's busybox cannot go into the guest, or "".
func checkBusybox() string {
	bb := os.Getenv(envBusybox)
	if bb == "" {
		bb = "/bin/busybox"
	}
	f, err := elf.Open(bb)
	if errors.Is(err, os.ErrNotExist) {
		return "busybox-static not installed: " + bb + " not found (apt-get install busybox-static)"
	}
	if err != nil {
		return fmt.Sprintf("cannot read %s: %v", bb, err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return bb + " is dynamically linked; the guest needs a static one (apt-get install busybox-static)"
		}
	}
	return ""
}

// RepoRoot is the module root: the directory holding go.mod above this
// package's source (or, when built with -trimpath, above the working
// directory).
func RepoRoot() (string, error) {
	var starts []string
	if _, file, _, ok := runtime.Caller(0); ok && filepath.IsAbs(file) {
		starts = append(starts, filepath.Dir(file))
	}
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	for _, dir := range starts {
		for {
			if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
				if _, err := os.Stat(filepath.Join(dir, buildScriptPath)); err == nil {
					return dir, nil
				}
			}
			parent := filepath.Dir(dir)
			if parent == dir {
				break
			}
			dir = parent
		}
	}
	return "", fmt.Errorf("cannot find the vmsnap repository root (a go.mod with %s beside it)", buildScriptPath)
}

func findBuildScript() (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	return filepath.Join(root, buildScriptPath), nil
}

// maxSocketPath is a safe length for a unix socket path (sun_path is 108
// bytes including the terminating NUL).
const maxSocketPath = 100

// FreeShortDir returns a new, empty directory with a short path (under
// $TMPDIR, or /tmp when that is too long), removed when t ends: short enough
// for unix sockets inside it.
func FreeShortDir(t testing.TB) string {
	t.Helper()
	base := os.TempDir()
	if len(base) > 40 {
		base = "/tmp"
	}
	dir, err := os.MkdirTemp(base, "vmsnap-")
	if err != nil {
		t.Fatalf("FreeShortDir: %v", err)
	}
	t.Cleanup(func() {
		if err := os.RemoveAll(dir); err != nil {
			t.Logf("removing %s: %v", dir, err)
		}
	})
	return dir
}

// DiskSizeMB is the size of the base image NewDisk creates.
const DiskSizeMB = 64

// NewDisk creates dir/base.qcow2 (an empty 64 MiB qcow2) and
// dir/overlay.qcow2 on top of it (relative backing file, -F qcow2), and
// returns the overlay's path.
func NewDisk(t testing.TB, dir string) (overlay string) {
	t.Helper()
	if _, err := exec.LookPath(QEMUImgBinary); err != nil {
		skipf(t, "%s not installed (apt-get install qemu-utils)", QEMUImgBinary)
	}
	dir, err := filepath.Abs(dir)
	if err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) {
		t.Helper()
		cmd := exec.Command(QEMUImgBinary, args...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s %s: %v\n%s", QEMUImgBinary, strings.Join(args, " "), err, out)
		}
	}
	run("create", "-q", "-f", "qcow2", "base.qcow2", fmt.Sprintf("%dM", DiskSizeMB))
	run("create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "overlay.qcow2")
	return filepath.Join(dir, "overlay.qcow2")
}
