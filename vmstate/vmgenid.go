package vmstate

import (
	"context"
	"errors"
	"regexp"
	"strings"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp"
)

// QEMU's vmgenid device (-device vmgenid,guid=auto) gives the guest a VM
// generation ID; Linux 5.18 and later reseed their RNG when it changes.
// Clones of one snapshot start with the same RNG state, so every restore
// must give its VM a fresh ID. The ID is not part of the migration stream:
// with guid=auto each target QEMU draws its own when it starts, and the
// device's post_load writes the target's ID into guest memory and notifies
// the guest. QEMU refuses to change it once the device is realized
// (qom-set: "Attempt to set property 'guid' ... after it was realized"),
// so vmsnap cannot set one itself: it refuses a target without the device
// and a target whose ID is the snapshot's own (a fixed guid= copied from
// the source's command line), before a byte is fed.

// VMGenIDDeviceArg is what a QEMU command line needs for a VM generation ID.
const VMGenIDDeviceArg = "-device vmgenid,guid=auto"

var guidRE = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// readGenerationID is the VM generation ID of the QEMU behind mon, in lower
// case, or "" when it has no vmgenid device. QEMU's reply is checked to be
// a GUID: nothing else ever goes into a record.
func readGenerationID(ctx context.Context, mon Executor) (string, error) {
	var reply struct {
		GUID string `json:"guid"`
	}
	err := mon.Execute(ctx, "query-vm-generation-id", nil, &reply)
	var refused *qmp.Error
	if errors.As(err, &refused) {
		// "VM Generation ID device not found", or a QEMU without the command.
		return "", nil
	}
	if err != nil {
		return "", err
	}
	return checkGUID(reply.GUID, "QEMU reported")
}

// checkGUID returns s in lower case if it is a GUID (8-4-4-4-12 hex digits).
func checkGUID(s, who string) (string, error) {
	g := strings.ToLower(s)
	if len(g) != 36 || !guidRE.MatchString(g) {
		return "", errcode.New(errcode.QMPError, "%s VM generation ID %.48q, which is not a GUID (8-4-4-4-12 hex digits)", who, s)
	}
	return g, nil
}

// compareVMGenID is Compare's check of the vmgenid device: a snapshot of a
// VM that had one needs a target that has one (or its stream does not
// load), with an ID of its own (or the guest would not notice the copy).
func compareVMGenID(src, target Record) []string {
	switch {
	case src.VMGenID == "":
		return nil
	case target.VMGenID == "":
		return []string{"VM generation ID: the snapshot's VM has a vmgenid device, the target has none (add " + VMGenIDDeviceArg + " to the target's QEMU command line)"}
	case target.VMGenID == src.VMGenID:
		return []string{"VM generation ID: the target's is the snapshot's own " + src.VMGenID + ", so the guest would not know it is a copy (start the target with " + VMGenIDDeviceArg + ", not a fixed guid=)"}
	}
	return nil
}

// restoredGenerationID is the ID a restored guest finds: the target's, if
// the snapshot's VM had the device (Compare checked it is another one).
func restoredGenerationID(src, target Record) string {
	if src.VMGenID == "" {
		return ""
	}
	return target.VMGenID
}
