//go:build !linux

package testguest

import "syscall"

func lockFile(path string) (unlock func(), err error) { return func() {}, nil }

func sysProcAttr() *syscall.SysProcAttr { return nil }

func directIOWorks(path string) bool { return false }
