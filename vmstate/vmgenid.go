package vmstate

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp"
)

// QEMU's vmgenid device (-device vmgenid,guid=auto) gives the guest a VM
// generation ID; Linux 5.18 and later reseed their RNG when it changes.
// Clones of one snapshot start with the same RNG state, so every restore
// gives its VM a fresh ID: with guid=auto QEMU draws one when it starts, and
// its vmgenid post_load hands the target's ID to the guest, but a target
// started with a fixed guid= (copied from the source's command line, or one
// template for all clones) would keep clones twins. So the restore sets a
// new random ID itself before the VM runs.

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
// VM that had one needs a target that has one, or its stream does not load
// (and its clones could not be told apart).
func compareVMGenID(src, target Record) []string {
	if src.VMGenID != "" && target.VMGenID == "" {
		return []string{"VM generation ID: the snapshot's VM has a vmgenid device, the target has none (add " + VMGenIDDeviceArg + " to the target's QEMU command line)"}
	}
	return nil
}

// freshGenerationID gives the loaded VM behind mon a new random generation
// ID, before it runs, and checks that QEMU reports it. It returns the new
// ID, or "" when the VM has no vmgenid device.
func freshGenerationID(ctx context.Context, mon Executor) (string, error) {
	old, err := readGenerationID(ctx, mon)
	if err != nil || old == "" {
		return "", errcode.Ensure(errcode.QMPError, err, "reading the restored VM's generation ID")
	}
	path, err := findVMGenID(ctx, mon)
	if err != nil {
		return "", err
	}
	guid, err := newGUID()
	if err != nil {
		return "", err
	}
	if err := mon.Execute(ctx, "qom-set", map[string]string{"path": path, "property": "guid", "value": guid}, nil); err != nil {
		return "", errcode.Ensure(errcode.QMPError, err, "giving the restored VM a fresh generation ID (qom-set %s guid)", path)
	}
	got, err := readGenerationID(ctx, mon)
	if err != nil {
		return "", errcode.Ensure(errcode.QMPError, err, "reading the restored VM's new generation ID")
	}
	if got != guid {
		return "", errcode.New(errcode.QMPError, "QEMU reports VM generation ID %s after vmsnap set %s: the restored VM is left stopped rather than run as a twin of its siblings", got, guid)
	}
	return guid, nil
}

// maxQOMName bounds a QOM child's name from qom-list (QEMU's are short:
// "device[12]", or a -device id).
const maxQOMName = 256

// findVMGenID is the QOM path of the vmgenid device (QEMU allows one), a
// -device with an id= or without.
func findVMGenID(ctx context.Context, mon Executor) (string, error) {
	for _, parent := range []string{"/machine/peripheral", "/machine/peripheral-anon"} {
		var children []struct {
			Name string `json:"name"`
			Type string `json:"type"`
		}
		if err := mon.Execute(ctx, "qom-list", map[string]string{"path": parent}, &children); err != nil {
			return "", errcode.Ensure(errcode.QMPError, err, "listing %s to find the vmgenid device", parent)
		}
		for _, c := range children {
			if c.Type == "child<vmgenid>" && c.Name != "" && len(c.Name) <= maxQOMName && !strings.ContainsAny(c.Name, "/\x00") {
				return parent + "/" + c.Name, nil
			}
		}
	}
	return "", errcode.New(errcode.QMPError, "QEMU reports a VM generation ID but lists no vmgenid device under /machine/peripheral or /machine/peripheral-anon")
}

// newGUID is a random (version 4) GUID.
func newGUID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", errcode.Wrap(errcode.Internal, err, "drawing a VM generation ID")
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]), nil
}
