package qmptest

import "github.com/vmsnap/vmsnap/qmp"

// fakeVMGenID is a FakeQEMU's vmgenid device (-device vmgenid): what
// query-vm-generation-id reports.
type fakeVMGenID struct {
	// VMGenID is the device's GUID as query-vm-generation-id reports it,
	// "" for a VM without the device. A test sets anything here to play a
	// hostile QEMU.
	VMGenID string
}

// handleVMGenID answers query-vm-generation-id (with f.mu held); handled
// is false for any other command.
func (f *FakeQEMU) handleVMGenID(cmd Command) (res any, qerr *qmp.Error, handled bool) {
	if cmd.Execute != "query-vm-generation-id" {
		return nil, nil, false
	}
	if f.VMGenID == "" {
		return nil, genericError("VM Generation ID device not found"), true
	}
	return map[string]string{"guid": f.VMGenID}, nil, true
}
