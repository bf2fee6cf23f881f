package guest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// Options configure Start. The zero value boots a 256 MiB, 1-CPU guest
// without a disk.
type Options struct {
	MemMB      int      // guest RAM in MiB (default 256)
	CPUs       int      // virtual CPUs (default 1)
	Disk       string   // qcow2 image attached as a virtio disk (/dev/vda), optional
	DiskCache  string   // -drive cache= mode; default "none", or "writeback" where the disk's filesystem refuses O_DIRECT
	Incoming   bool     // start with -incoming defer (a restore target)
	ExtraArgs  []string // appended to QEMU's command line
	GuestMemMB int      // size of the guest's random in-memory data (vmsnap.mem_mb, default 16)
	KernelArgs []string // appended to the kernel command line (e.g. "vmsnap.marker=new")
	Dir        string   // where the QMP socket, serial log and stderr go (default FreeShortDir)
	QEMURoot   string   // an unpacked QEMU tree to run (QEMU10's) instead of the system's QEMU
	Kernel     Kernel   // the guest kernel's flavour (default KernelCloud)
	// Launcher runs QEMU through a command that execs it (vmsnap launch
	// ... --): Launcher, then QEMU's path and arguments. The launcher must
	// exec QEMU, so that the process Start watches is QEMU's.
	Launcher []string
}

// Defaults of Options.
const (
	DefaultMemMB      = 256
	DefaultCPUs       = 1
	DefaultGuestMemMB = 16
)

// KernelCmdline is the guest kernel command line before vmsnap.* parameters.
// no_timer_check: under TCG on a loaded host the kernel's early check that
// the timer interrupt arrives through the IO-APIC can run out of time and
// panic the boot ("IO-APIC + timer doesn't work!"); the timer is QEMU's
// and known good.
const KernelCmdline = "console=ttyS0 panic=-1 quiet no_timer_check"

// VM is a running QEMU started by Start. Its files (QMP socket, serial log,
// QEMU's stderr) are named vmN.* in Options.Dir, so several VMs (a source and
// its restore target) can share a directory.
type VM struct {
	t          testing.TB
	name       string
	args       []string
	dir        string
	qmpPath    string
	serialPath string
	stderrPath string
	started    time.Time

	cmd     *exec.Cmd
	done    chan struct{} // closed when the process has exited
	waitErr error         // valid once done is closed

	mu         sync.Mutex
	parsedOff  int64 // serial log bytes already parsed
	statuses   []Status
	ready      *Status
	readyCount int
}

var vmSeq atomic.Int64

// Start boots the test guest in QEMU (TCG unless VMSNAP_TEST_KVM=1) and waits
// until its QMP socket exists. The VM is killed when t ends (after a QMP
// "quit" attempt); if t failed, QEMU's stderr and the serial log's tail are
// logged. The device set does not depend on Incoming, so the state of a VM
// started without it loads into one started with it and the same Options.
func Start(t testing.TB, opts Options) *VM {
	t.Helper()
	if opts.Kernel == "" {
		opts.Kernel = KernelCloud
	}
	kernel, initrd := KernelAssets(t, opts.Kernel)
	qemu, err := exec.LookPath(QEMUBinary)
	if err != nil {
		skipf(t, "%s not installed (apt-get install qemu-system-x86)", QEMUBinary)
	}
	var qemuArgs, qemuEnv []string
	if opts.QEMURoot != "" {
		qemu, qemuArgs, qemuEnv = qemuFromRoot(opts.QEMURoot)
	}
	if opts.MemMB == 0 {
		opts.MemMB = DefaultMemMB
	}
	if opts.CPUs == 0 {
		opts.CPUs = DefaultCPUs
	}
	if opts.GuestMemMB == 0 {
		opts.GuestMemMB = DefaultGuestMemMB
	}
	dir := opts.Dir
	if dir == "" {
		dir = FreeShortDir(t)
	}
	if dir, err = filepath.Abs(dir); err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("vm%d", vmSeq.Add(1))
	vm := &VM{
		t:          t,
		name:       name,
		dir:        dir,
		qmpPath:    filepath.Join(dir, name+".qmp"),
		serialPath: filepath.Join(dir, name+".serial"),
		stderrPath: filepath.Join(dir, name+".stderr"),
		done:       make(chan struct{}),
	}
	if len(vm.qmpPath) > maxSocketPath {
		vm.qmpPath = filepath.Join(FreeShortDir(t), name+".qmp")
	}

	accel := "tcg"
	if os.Getenv(EnvKVM) == "1" {
		accel = "kvm"
	}
	cmdline := KernelCmdline + " vmsnap.mem_mb=" + strconv.Itoa(opts.GuestMemMB)
	if len(opts.KernelArgs) > 0 {
		cmdline += " " + strings.Join(opts.KernelArgs, " ")
	}
	args := []string{
		"-accel", accel,
		"-machine", "pc",
		"-m", strconv.Itoa(opts.MemMB),
		"-smp", strconv.Itoa(opts.CPUs),
		"-nodefaults", "-no-user-config",
		"-display", "none",
		"-no-reboot",
		"-kernel", kernel,
		"-initrd", initrd,
		"-append", cmdline,
		"-chardev", "file,id=serial0,path=" + qemuEscape(vm.serialPath),
		"-serial", "chardev:serial0",
		"-chardev", "socket,id=qmp0,path=" + qemuEscape(vm.qmpPath) + ",server=on,wait=off",
		"-mon", "chardev=qmp0,mode=control",
	}
	if opts.Disk != "" {
		disk, err := filepath.Abs(opts.Disk)
		if err != nil {
			t.Fatal(err)
		}
		cache := opts.DiskCache
		if cache == "" {
			cache = "none"
			if !directIOWorks(disk) {
				cache = "writeback"
				t.Logf("guest: %s refuses O_DIRECT; using cache=writeback", disk)
			}
		}
		args = append(args, "-drive", "file="+qemuEscape(disk)+",if=virtio,format=qcow2,cache="+cache)
	}
	if opts.Incoming {
		args = append(args, "-incoming", "defer")
	}
	args = append(args, opts.ExtraArgs...)
	args = append(qemuArgs, args...)
	vm.args = append([]string{qemu}, args...)

	stderr, err := os.Create(vm.stderrPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(qemu, args...)
	if len(opts.Launcher) > 0 {
		cmd = exec.Command(opts.Launcher[0], append(append(opts.Launcher[1:len(opts.Launcher):len(opts.Launcher)], qemu), args...)...)
		vm.args = append(append([]string(nil), opts.Launcher...), vm.args...)
	}
	cmd.Dir = dir
	cmd.Stdout = stderr
	cmd.Stderr = stderr
	cmd.SysProcAttr = sysProcAttr()
	if qemuEnv != nil {
		cmd.Env = append(os.Environ(), qemuEnv...)
	}
	t.Logf("guest: starting %s: %s", name, shellQuote(vm.args))
	vm.started = time.Now()
	if err := cmd.Start(); err != nil {
		stderr.Close()
		t.Fatalf("starting %s: %v", QEMUBinary, err)
	}
	vm.cmd = cmd
	go func() {
		vm.waitErr = cmd.Wait()
		stderr.Close()
		close(vm.done)
	}()
	t.Cleanup(vm.cleanup)

	// QEMU listens on the socket before it starts the guest. The file
	// appears at bind(), a moment before listen(): a connection in between
	// is refused, so wait for one that is accepted.
	deadline := time.Now().Add(30 * time.Second)
	for {
		if conn, err := net.DialTimeout("unix", vm.qmpPath, time.Second); err == nil {
			conn.Close()
			break
		}
		select {
		case <-vm.done:
			t.Fatalf("%s exited before creating its QMP socket: %v\n%s", QEMUBinary, vm.waitErr, vm.Stderr())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not create its QMP socket %s within 30s\n%s", QEMUBinary, vm.qmpPath, vm.Stderr())
		}
	}
	return vm
}

// qemuEscape escapes a value for QEMU's comma-separated option syntax.
func qemuEscape(s string) string { return strings.ReplaceAll(s, ",", ",,") }

func shellQuote(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		if a != "" && strings.Trim(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_=.,:/+") == "" {
			q[i] = a
		} else {
			q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
	}
	return strings.Join(q, " ")
}

func (vm *VM) cleanup() {
	if !vm.Exited() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, _ = vm.QMP(ctx, "quit", nil)
		cancel()
		select {
		case <-vm.done:
		case <-time.After(3 * time.Second):
		}
		vm.Kill()
	}
	if vm.t.Failed() {
		vm.t.Logf("guest: %s command: %s", vm.name, shellQuote(vm.args))
		vm.t.Logf("guest: %s exit: %v; stderr:\n%s", vm.name, vm.waitErr, vm.Stderr())
		vm.t.Logf("guest: %s serial log (tail):\n%s", vm.name, vm.SerialTail(30))
	}
}

// Name is the VM's label (vm1, vm2, ...), also the prefix of its files.
func (vm *VM) Name() string { return vm.name }

// Args is QEMU's full command line, program first.
func (vm *VM) Args() []string { return append([]string(nil), vm.args...) }

// Dir is the directory holding the VM's files.
func (vm *VM) Dir() string { return vm.dir }

// QMPPath is the QMP unix socket.
func (vm *VM) QMPPath() string { return vm.qmpPath }

// SerialPath is the file the guest's serial console is written to.
func (vm *VM) SerialPath() string { return vm.serialPath }

// StderrPath is the file QEMU's stdout and stderr go to.
func (vm *VM) StderrPath() string { return vm.stderrPath }

// Started is when the QEMU process was started.
func (vm *VM) Started() time.Time { return vm.started }

// Process is the QEMU process.
func (vm *VM) Process() *os.Process { return vm.cmd.Process }

// Exited reports whether QEMU has exited.
func (vm *VM) Exited() bool {
	select {
	case <-vm.done:
		return true
	default:
		return false
	}
}

// Done is closed when QEMU has exited.
func (vm *VM) Done() <-chan struct{} { return vm.done }

// Wait waits for QEMU to exit and returns its exit error (nil for status 0),
// or ctx's error.
func (vm *VM) Wait(ctx context.Context) error {
	select {
	case <-vm.done:
		return vm.waitErr
	case <-ctx.Done():
		return ctx.Err()
	}
}

// ExitErr is QEMU's exit error once it has exited (nil while it runs or after
// a clean exit).
func (vm *VM) ExitErr() error {
	if !vm.Exited() {
		return nil
	}
	return vm.waitErr
}

// Kill sends SIGKILL to QEMU and waits for it to exit.
func (vm *VM) Kill() {
	if vm.Exited() {
		return
	}
	_ = vm.cmd.Process.Signal(syscall.SIGKILL)
	<-vm.done
}

// Stderr is what QEMU has written to stdout and stderr so far.
func (vm *VM) Stderr() string {
	b, err := os.ReadFile(vm.stderrPath)
	if err != nil {
		return fmt.Sprintf("(reading %s: %v)", vm.stderrPath, err)
	}
	return string(b)
}

// SerialTail is the last n lines of the serial log.
func (vm *VM) SerialTail(n int) string {
	b, err := os.ReadFile(vm.serialPath)
	if err != nil {
		return fmt.Sprintf("(reading %s: %v)", vm.serialPath, err)
	}
	lines := strings.Split(strings.ReplaceAll(string(b), "\r", ""), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
