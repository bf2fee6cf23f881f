package vmstate

import (
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

func sampleRecord() Record {
	devices := []string{"00:00.0 8086:1237 class=0600", "00:02.0 1af4:1001 class=0100"}
	return Record{
		QEMUVersion: "7.2.22", Arch: "x86_64", Machine: "pc-i440fx-7.2-machine",
		CPUs: 1, CPUModel: "qemu64-x86_64-cpu", MemoryBytes: 256 << 20,
		Devices: devices, DevicesHash: devicesDigest(devices),
		Blocks: []Block{{Device: "virtio0", QDev: "/machine/peripheral-anon/device[0]/virtio-backend", Format: "qcow2", VirtualSize: 64 << 20}},
	}
}

func TestCompareIdenticalAndNewerQEMU(t *testing.T) {
	src := sampleRecord()
	if d := Compare(src, src); len(d) != 0 {
		t.Fatalf("identical records differ: %v", d)
	}
	newer := sampleRecord()
	newer.QEMUVersion = "8.2.0"
	newer.QEMUPackage = "something else"
	if d := Compare(src, newer); len(d) != 0 {
		t.Fatalf("a newer QEMU with the same machine type must be accepted: %v", d)
	}
	micro := sampleRecord()
	micro.QEMUVersion = "7.2.11"
	if d := Compare(src, micro); len(d) != 0 {
		t.Fatalf("an older micro release of the same minor version must be accepted: %v", d)
	}
	older := sampleRecord()
	older.QEMUVersion = "7.1.9"
	if d := Compare(src, older); len(d) != 1 || !strings.Contains(d[0], "older") {
		t.Fatalf("an older QEMU must be refused: %v", d)
	}
}

func TestCompareListsEveryDifference(t *testing.T) {
	src := sampleRecord()
	dst := sampleRecord()
	dst.MemoryBytes = 512 << 20
	dst.CPUs = 2
	dst.Machine = "pc-q35-7.2-machine"
	dst.Devices = append([]string{}, src.Devices[0], "00:03.0 1af4:1000 class=0200")
	dst.DevicesHash = devicesDigest(dst.Devices)
	dst.Blocks[0].Format = "raw"
	diffs := Compare(src, dst)
	for _, want := range []string{"memory: snapshot has 256 MiB, target has 512 MiB", "vCPU count", "machine type",
		"PCI device missing on target: 00:02.0", "PCI device not in snapshot: 00:03.0", "virtio0 format"} {
		found := false
		for _, d := range diffs {
			found = found || strings.Contains(d, want)
		}
		if !found {
			t.Errorf("no difference mentions %q in %q", want, diffs)
		}
	}
	err := CheckCompatible(src, dst)
	if errcode.Of(err) != errcode.CompatMismatch || !strings.Contains(err.Error(), "512 MiB") {
		t.Fatalf("CheckCompatible = %v", err)
	}
}

func TestCompareBlockDevicesBothWays(t *testing.T) {
	src := sampleRecord()
	dst := sampleRecord()
	dst.Blocks = []Block{{Device: "virtio1", Format: "qcow2", VirtualSize: 64 << 20}}
	diffs := Compare(src, dst)
	if len(diffs) != 2 || !strings.Contains(strings.Join(diffs, "|"), "virtio0 missing on target") ||
		!strings.Contains(strings.Join(diffs, "|"), "virtio1 not in snapshot") {
		t.Fatalf("diffs = %q", diffs)
	}
}

func TestRecordValidate(t *testing.T) {
	if err := sampleRecord().Validate(); err != nil {
		t.Fatal(err)
	}
	bad := map[string]func(*Record){
		"no machine":      func(r *Record) { r.Machine = "" },
		"zero cpus":       func(r *Record) { r.CPUs = 0 },
		"negative memory": func(r *Record) { r.MemoryBytes = -1 },
		"forged devices":  func(r *Record) { r.Devices = append(r.Devices, "00:09.0 dead:beef class=0000") },
	}
	for name, f := range bad {
		r := sampleRecord()
		f(&r)
		if err := r.Validate(); errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("%s: err = %v, want INVALID_INPUT", name, err)
		}
	}
}

func TestCmpVersion(t *testing.T) {
	for _, c := range []struct {
		a, b string
		sign int
	}{{"7.2.22", "7.2.3", 1}, {"7.2", "7.2.0", 0}, {"10.0.0", "9.2.1", 1}, {"7.1.9", "7.2.0", -1}} {
		got := cmpVersion(c.a, c.b)
		if (got > 0) != (c.sign > 0) || (got < 0) != (c.sign < 0) {
			t.Errorf("cmpVersion(%s, %s) = %d", c.a, c.b, got)
		}
	}
}
