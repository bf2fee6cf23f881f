// Package hook holds the points where the tests of one package step
// into an operation of another while it runs (the agent's tests into a
// checkpoint of package internal/snapshot, or of the agent itself). Only
// tests set them, through Swap.
package hook

// BeforeDiskCapture runs in every checkpoint while the VM is stopped, just
// before its disk overlay is read: when a hostile QEMU knows its migration
// stream has ended. Tests swap the overlay's path there.
var BeforeDiskCapture = func() {}

// AfterResolve runs in every checkpoint of the agent between resolving
// the VM and using the files resolved: tests swap the VM's files there.
var AfterResolve = func() {}

// Swap makes the hook at point run f, and returns what puts the previous
// one back (for t.Cleanup).
func Swap(point *func(), f func()) (restore func()) {
	old := *point
	*point = f
	return func() { *point = old }
}
