package vmstate

import (
	"context"
	"encoding/json"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
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

// hostRecord is a record of a VM with -cpu host on some host: the CPU
// model's name alone says nothing about its features.
func hostRecord(features map[string]uint32) Record {
	r := sampleRecord()
	r.CPUModel = "host-x86_64-cpu"
	r.CPUFeatures = features
	return r
}

func TestCompareCPUFeatureWords(t *testing.T) {
	src := hostRecord(map[string]uint32{"0x1:ECX": 0x80002001, "0x7.0:EBX": 1<<5 | 1<<16 | 1<<12, "0xd.1:EAX": 0x1})
	if d := Compare(src, src); len(d) != 0 {
		t.Fatalf("identical features differ: %v", d)
	}
	// Another host: no avx2, avx512f nor bit 12 (unnamed), but sha-ni and
	// a word the source did not have.
	dst := hostRecord(map[string]uint32{"0x1:ECX": 0x80002001, "0x7.0:EBX": 1 << 29, "0x80000001:ECX": 1 << 6, "0xd.1:EAX": 0x1})
	diffs := Compare(src, dst)
	want := []string{
		"CPU features missing on target (CPUID 0x7.0:EBX): avx2 (bit 5), bit 12, avx512f (bit 16)",
		"CPU features not in snapshot (CPUID 0x7.0:EBX): sha-ni (bit 29)",
		"CPU features not in snapshot (CPUID 0x80000001:ECX): sse4a (bit 6)",
	}
	if strings.Join(diffs, "\n") != strings.Join(want, "\n") {
		t.Fatalf("diffs:\n%s\nwant:\n%s", strings.Join(diffs, "\n"), strings.Join(want, "\n"))
	}
	err := CheckCompatible(src, dst)
	if errcode.Of(err) != errcode.CompatMismatch || len(errcode.DetailsOf(err)) != 3 {
		t.Fatalf("CheckCompatible = %v", err)
	}

	// The target's QEMU says why a feature is missing when it filtered it.
	dst = hostRecord(map[string]uint32{"0x1:ECX": 0x80002001, "0x7.0:EBX": 1<<16 | 1<<12, "0xd.1:EAX": 0x1})
	dst.CPUFiltered = map[string]uint32{"0x7.0:EBX": 1 << 5}
	if d := Compare(src, dst); len(d) != 1 || !strings.Contains(d[0], "avx2 (bit 5) (the target's QEMU filtered them out") {
		t.Fatalf("diffs = %q", d)
	}
}

func TestCompareCPUFeatureWordsOlderRecords(t *testing.T) {
	// A record from before vmsnap read feature words restores anywhere
	// its model matches.
	old := sampleRecord()
	now := sampleRecord()
	now.CPUFeatures = map[string]uint32{"0x1:EDX": 0x078bfbfd}
	if d := Compare(old, now); len(d) != 0 {
		t.Fatalf("a record without feature words is refused: %v", d)
	}
	// A target that cannot report them cannot be checked: refused.
	if d := Compare(now, old); len(d) != 1 || !strings.Contains(d[0], "the target QEMU reports none") {
		t.Fatalf("diffs = %q", d)
	}
	// Unless it differs in architecture, which says it all.
	other := sampleRecord()
	other.Arch = "aarch64"
	if d := Compare(now, other); len(d) != 1 || !strings.Contains(d[0], "architecture") {
		t.Fatalf("diffs = %q", d)
	}
}

func TestRecordValidateCPUFeatureWords(t *testing.T) {
	good := hostRecord(map[string]uint32{"0x1:EDX": 1, "0x7.0:EBX": 2, "0x80000001:ECX": 3, "0xd.1:EAX": 4})
	good.CPUFiltered = map[string]uint32{"0x7.0:EBX": 8}
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"", "0x1", "1:EDX", "0x1:edx", "0x01:EDX", "0x1:ESP", "0x7.:EBX", "0x7.00:EBX", "0x1ffffffff:EAX", "0xz:EAX", "0x7.-1:EBX"} {
		r := hostRecord(map[string]uint32{key: 1})
		if err := r.Validate(); errcode.Of(err) != errcode.InvalidInput {
			t.Errorf("key %q: err = %v, want INVALID_INPUT", key, err)
		}
	}
	many := map[string]uint32{}
	for i := range maxCPUIDWords + 1 {
		many[cpuidKey(uint32(i), nil, "EAX")] = 1
	}
	if err := hostRecord(many).Validate(); errcode.Of(err) != errcode.InvalidInput {
		t.Errorf("%d words: err = %v, want INVALID_INPUT", len(many), err)
	}
}

func TestReadRecordCPUFeatureWords(t *testing.T) {
	ctx := context.Background()
	q := qmptest.NewFakeQEMU(t, "running", nil)
	r, err := ReadRecord(ctx, q.Dial(t))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]uint32{"0x1:EDX": 0x078bfbfd, "0x1:ECX": 0x80002001, "0x80000001:EDX": 0x2193fbfd, "0x80000001:ECX": 0x5}
	if !maps.Equal(r.CPUFeatures, want) || r.CPUFiltered != nil {
		t.Fatalf("features %v, filtered %v; want %v and none", r.CPUFeatures, r.CPUFiltered, want)
	}
	if err := r.Validate(); err != nil {
		t.Fatal(err)
	}

	// QEMU for another architecture has no such properties.
	other := qmptest.NewFakeQEMU(t, "running", nil)
	other.FeatureWords, other.FilteredFeatures = nil, nil
	if r, err := ReadRecord(ctx, other.Dial(t)); err != nil || r.CPUFeatures != nil || r.CPUFiltered != nil {
		t.Fatalf("without feature words: %v, %v, %v", err, r.CPUFeatures, r.CPUFiltered)
	}
}

func TestRestoreRefusesOtherCPUFeaturesBeforeSendingAByte(t *testing.T) {
	ref := checkpointInto(t, t.TempDir(), chunkdata.Stream(t, 1<<20))
	// The same CPU model, on a host with avx2 (as -cpu host would be).
	dst := qmptest.NewFakeQEMU(t, "inmigrate", nil)
	zero := uint32(0)
	dst.FeatureWords = append(qmptest.Qemu64FeatureWords(), qmptest.FeatureWord{Register: "EBX", InputEAX: 7, InputECX: &zero, Features: 1 << 5})
	_, err := Restore(context.Background(), dst.Dial(t), openLayout(t, ref.String()), RestoreOptions{})
	if errcode.Of(err) != errcode.CompatMismatch ||
		!slices.Equal(errcode.DetailsOf(err), []string{"CPU features not in snapshot (CPUID 0x7.0:EBX): avx2 (bit 5)"}) {
		t.Fatalf("err = %v (details %q), want COMPAT_MISMATCH naming avx2 alone", err, errcode.DetailsOf(err))
	}
	if slices.Contains(dst.Commands(), "getfd") || dst.Status() != "inmigrate" {
		t.Fatalf("the target was touched: %v, status %s", dst.Commands(), dst.Status())
	}
}

// executorFunc answers QMP commands from a function, as a QEMU would.
type executorFunc func(command string) (string, error)

func (f executorFunc) Execute(_ context.Context, command string, _, result any) error {
	reply, err := f(command)
	if err != nil {
		return err
	}
	return json.Unmarshal([]byte(reply), result)
}

// TestReadPCIWalksBridges reads query-pci's answer as QEMU gives it for a
// device behind a PCI bridge (the bridge's bus is an object there, the
// root bus's a number): every function is listed, sorted.
func TestReadPCIWalksBridges(t *testing.T) {
	reply := `[{"bus": 0, "devices": [
		{"bus": 0, "slot": 3, "function": 0, "class_info": {"class": 1540}, "id": {"vendor": 6966, "device": 1}, "qdev_id": "br0",
		 "pci_bridge": {"bus": {"number": 1, "secondary": 1, "subordinate": 1}, "devices": [
			{"bus": 1, "slot": 1, "function": 0, "class_info": {"class": 512}, "id": {"vendor": 6900, "device": 4096}, "qdev_id": "net0"}]}},
		{"bus": 0, "slot": 0, "function": 0, "class_info": {"class": 1536}, "id": {"vendor": 32902, "device": 4663}}]}]`
	got, err := readPCI(context.Background(), executorFunc(func(string) (string, error) { return reply, nil }))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"00:00.0 8086:1237 class=0600",
		"00:03.0 1b36:0001 class=0604 id=br0",
		"01:01.0 1af4:1000 class=0200 id=net0",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("devices:\n%q\nwant\n%q", got, want)
	}
}
