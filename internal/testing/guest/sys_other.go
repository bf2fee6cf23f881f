//go:build !linux

package guest

import "syscall"

func LockFile(path string) (unlock func(), err error) { return func() {}, nil }

func sysProcAttr() *syscall.SysProcAttr { return nil }

func directIOWorks(path string) bool { return false }
