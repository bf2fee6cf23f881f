// Package hook holds the points where the tests of one package step
// into an operation of another while it runs (the agent's tests into a
// checkpoint of package internal/snapshot). Only tests set them.
package hook

// BeforeDiskCapture runs in every checkpoint while the VM is stopped, just
// before its disk overlay is read: when a hostile QEMU knows its migration
// stream has ended. Tests swap the overlay's path there.
var BeforeDiskCapture = func() {}
