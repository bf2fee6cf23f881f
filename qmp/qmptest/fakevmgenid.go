package qmptest

import "github.com/vmsnap/vmsnap/qmp"

// fakeVMGenID is a FakeQEMU's vmgenid device (-device vmgenid): what
// query-vm-generation-id reports and qom-set of its guid changes.
type fakeVMGenID struct {
	// VMGenID is the device's GUID as query-vm-generation-id reports it,
	// "" for a VM without the device. A test sets anything here to play a
	// hostile QEMU.
	VMGenID string
	// VMGenIDIgnoresSet makes qom-set of the guid succeed without changing
	// it, as a broken or hostile QEMU might.
	VMGenIDIgnoresSet bool
	// VMGenIDSets counts the qom-set commands that changed the guid.
	VMGenIDSets int
}

// vmgenidPath is where the fake's anonymous vmgenid device lives.
const vmgenidPath = "/machine/peripheral-anon/device[0]"

// handleVMGenID answers the vmgenid commands (with f.mu held); handled is
// false for any other command.
func (f *FakeQEMU) handleVMGenID(cmd Command) (res any, qerr *qmp.Error, handled bool) {
	switch cmd.Execute {
	case "query-vm-generation-id":
		if f.VMGenID == "" {
			return nil, genericError("VM Generation ID device not found"), true
		}
		return map[string]string{"guid": f.VMGenID}, nil, true
	case "qom-list":
		var a struct{ Path string }
		_ = cmd.Args(&a)
		children := []map[string]string{{"name": "type", "type": "string"}}
		if a.Path == "/machine/peripheral-anon" && f.VMGenID != "" {
			children = append(children, map[string]string{"name": "device[0]", "type": "child<vmgenid>"})
		}
		return children, nil, true
	case "qom-set":
		var a struct{ Path, Property, Value string }
		_ = cmd.Args(&a)
		if f.VMGenID == "" || a.Path != vmgenidPath || a.Property != "guid" {
			return nil, genericError("Device '" + a.Path + "' not found"), true
		}
		if !f.VMGenIDIgnoresSet {
			f.VMGenID = a.Value
			f.VMGenIDSets++
		}
		return nil, nil, true
	}
	return nil, nil, false
}
