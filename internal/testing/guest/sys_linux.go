//go:build linux

package guest

import (
	"os"
	"syscall"
)

// LockFile takes an exclusive flock on path, creating it, and waits for
// it; the returned function releases it. Test harnesses share caches and
// hosts between test binaries through such locks.
func LockFile(path string) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	for {
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX)
		if err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return func() {
		syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		f.Close()
	}, nil
}

// sysProcAttr makes QEMU die with the test binary (a test timeout panics and
// exits without running cleanups).
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// directIOWorks reports whether path can be opened with O_DIRECT (which QEMU's
// cache=none needs; tmpfs, for one, refuses it).
func directIOWorks(path string) bool {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_DIRECT, 0)
	if err != nil {
		return false
	}
	f.Close()
	return true
}
