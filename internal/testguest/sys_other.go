//go:build !linux

package testguest

import "syscall"

func LockFile(path string) (unlock func(), err error) { return func() {}, nil }

func sysProcAttr() *syscall.SysProcAttr { return nil }

func directIOWorks(path string) bool { return false }
