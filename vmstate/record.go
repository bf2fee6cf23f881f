package vmstate

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"math/bits"
	"slices"
	"strconv"
	"strings"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp"
)

// Record is what a VM is, as far as loading its migration stream is
// concerned. It is read from the source QEMU at checkpoint and from the
// waiting target QEMU at restore; Compare says whether the stream will load.
type Record struct {
	QEMUVersion string   `json:"qemuVersion"`           // major.minor.micro
	QEMUPackage string   `json:"qemuPackage,omitempty"` // for people; not compared
	Arch        string   `json:"arch"`
	Machine     string   `json:"machine"` // the resolved, versioned machine type
	CPUs        int      `json:"cpus"`
	CPUModel    string   `json:"cpuModel"`
	MemoryBytes int64    `json:"memoryBytes"`
	Devices     []string `json:"devices"`       // PCI functions, canonical and sorted
	DevicesHash string   `json:"devicesDigest"` // sha256 of Devices, for a quick look
	Blocks      []Block  `json:"blocks"`

	// CPUFeatures are the CPUID feature words the guest sees (x86 only), by
	// cpuidKey, zero words left out. The model's name does not pin them:
	// -cpu host gives the host CPU's features, and so does a named model
	// with features added or removed.
	// Empty in records from before vmsnap read them, and on other
	// architectures: nothing is compared then.
	CPUFeatures map[string]uint32 `json:"cpuFeatures,omitempty"`
	// CPUFiltered are features the CPU model asked for that the host could
	// not give (QEMU filtered them out), likewise. Not compared: they only
	// explain a difference of CPUFeatures.
	CPUFiltered map[string]uint32 `json:"cpuFiltered,omitempty"`

	// RAM is the memory backend the machine's RAM lives in, if it names
	// one (-machine memory-backend=ID): QEMU migrates its pages under that
	// ID. Nil for a plain -m, and in records from before vmsnap read it.
	RAM *RAMBackend `json:"ramBackend,omitempty"`

	// VMGenID is the VM generation ID of the VM's vmgenid device (a GUID,
	// lower case), "" if it has none (and in records from before vmsnap
	// read it). A target must have the device too; each restore gives the
	// guest a fresh ID (vmgenid.go).
	VMGenID string `json:"vmGenID,omitempty"`
}

// Block is one block device as the guest sees it. File names are left out:
// they differ between nodes and do not matter to the stream.
type Block struct {
	Device      string `json:"device"`
	QDev        string `json:"qdev,omitempty"`
	Format      string `json:"format,omitempty"` // empty: no medium
	VirtualSize int64  `json:"virtualSize,omitempty"`
	ReadOnly    bool   `json:"readOnly,omitempty"`
}

// Executor is the part of the QMP client the record needs.
type Executor interface {
	Execute(ctx context.Context, command string, args, result any) error
}

// ReadRecord queries QEMU for the record. Every command it uses is answered
// by a QEMU waiting with -incoming defer as well as by a running one.
func ReadRecord(ctx context.Context, mon Executor) (Record, error) {
	var r Record
	var version struct {
		QEMU    struct{ Major, Minor, Micro int } `json:"qemu"`
		Package string                            `json:"package"`
	}
	if err := mon.Execute(ctx, "query-version", nil, &version); err != nil {
		return r, err
	}
	r.QEMUVersion = fmt.Sprintf("%d.%d.%d", version.QEMU.Major, version.QEMU.Minor, version.QEMU.Micro)
	r.QEMUPackage = strings.TrimSpace(version.Package)

	var target struct{ Arch string }
	if err := mon.Execute(ctx, "query-target", nil, &target); err != nil {
		return r, err
	}
	r.Arch = target.Arch

	if err := mon.Execute(ctx, "qom-get", map[string]string{"path": "/machine", "property": "type"}, &r.Machine); err != nil {
		return r, err
	}

	var cpus []struct {
		QOMPath string `json:"qom-path"`
	}
	if err := mon.Execute(ctx, "query-cpus-fast", nil, &cpus); err != nil {
		return r, err
	}
	r.CPUs = len(cpus)
	if len(cpus) > 0 {
		if err := mon.Execute(ctx, "qom-get", map[string]string{"path": cpus[0].QOMPath, "property": "type"}, &r.CPUModel); err != nil {
			return r, err
		}
		var err error
		if r.CPUFeatures, err = readCPUIDWords(ctx, mon, cpus[0].QOMPath, "feature-words"); err != nil {
			return r, err
		}
		if r.CPUFiltered, err = readCPUIDWords(ctx, mon, cpus[0].QOMPath, "filtered-features"); err != nil {
			return r, err
		}
	}

	var mem struct {
		Base    int64 `json:"base-memory"`
		Plugged int64 `json:"plugged-memory"`
	}
	if err := mon.Execute(ctx, "query-memory-size-summary", nil, &mem); err != nil {
		return r, err
	}
	r.MemoryBytes = mem.Base + mem.Plugged

	devices, err := readPCI(ctx, mon)
	if err != nil {
		return r, err
	}
	r.Devices = devices
	r.DevicesHash = devicesDigest(devices)

	blocks, err := readBlocks(ctx, mon)
	if err != nil {
		return r, err
	}
	r.Blocks = blocks

	if r.RAM, err = readRAMBackend(ctx, mon); err != nil {
		return r, err
	}
	if r.VMGenID, err = readGenerationID(ctx, mon); err != nil {
		return r, err
	}
	return r, nil
}

// readCPUIDWords reads an x86 CPU's feature-words or filtered-features
// property, keeping the words that are not zero. A QEMU without the
// property (another architecture) refuses the qom-get: that gives nil.
func readCPUIDWords(ctx context.Context, mon Executor, cpuPath, property string) (map[string]uint32, error) {
	var words []struct {
		Register string  `json:"cpuid-register"`
		EAX      uint32  `json:"cpuid-input-eax"`
		ECX      *uint32 `json:"cpuid-input-ecx"`
		Features uint32  `json:"features"`
	}
	err := mon.Execute(ctx, "qom-get", map[string]string{"path": cpuPath, "property": property}, &words)
	var refused *qmp.Error
	if errors.As(err, &refused) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	out := map[string]uint32{}
	for _, w := range words {
		if w.Features != 0 {
			out[cpuidKey(w.EAX, w.ECX, w.Register)] = w.Features
		}
	}
	if len(out) == 0 {
		return nil, nil
	}
	return out, nil
}

// cpuidKey names a CPUID feature word: the leaf (input EAX) in hex, the
// subleaf (input ECX) for leaves that have them, and the output register,
// as in "0x7.0:EBX" or "0x80000001:EDX".
func cpuidKey(leaf uint32, subleaf *uint32, register string) string {
	k := fmt.Sprintf("0x%x", leaf)
	if subleaf != nil {
		k += fmt.Sprintf(".%d", *subleaf)
	}
	return k + ":" + strings.ToUpper(register)
}

// compareCPUFeatures lists the CPUID feature bits that differ, one line per
// word and direction. A word absent from a record is zero.
func compareCPUFeatures(src, target Record) []string {
	if len(src.CPUFeatures) == 0 {
		return nil // an older record, or not x86: nothing to compare
	}
	if len(target.CPUFeatures) == 0 {
		if src.Arch != target.Arch {
			return nil // listed already
		}
		return []string{"CPU features: the snapshot records its CPUID feature words, the target QEMU reports none"}
	}
	words := maps.Clone(src.CPUFeatures)
	maps.Copy(words, target.CPUFeatures)
	var diffs []string
	for _, k := range slices.Sorted(maps.Keys(words)) {
		s, t := src.CPUFeatures[k], target.CPUFeatures[k]
		if missing := s &^ t; missing != 0 {
			d := fmt.Sprintf("CPU features missing on target (CPUID %s): %s", k, cpuFeatureNames(k, missing))
			if f := target.CPUFiltered[k]; f&missing == missing {
				d += " (the target's QEMU filtered them out: its host CPU lacks them)"
			}
			diffs = append(diffs, d)
		}
		if extra := t &^ s; extra != 0 {
			diffs = append(diffs, fmt.Sprintf("CPU features not in snapshot (CPUID %s): %s", k, cpuFeatureNames(k, extra)))
		}
	}
	return diffs
}

// parseCPUIDKey is cpuidKey's inverse.
func parseCPUIDKey(k string) (leaf uint32, subleaf *uint32, register string, ok bool) {
	word, register, _ := strings.Cut(k, ":")
	switch register {
	case "EAX", "EBX", "ECX", "EDX":
	default:
		return 0, nil, "", false
	}
	leafStr, subStr, hasSub := strings.Cut(word, ".")
	hex, ok := strings.CutPrefix(leafStr, "0x")
	if !ok {
		return 0, nil, "", false
	}
	l, err := strconv.ParseUint(hex, 16, 32)
	if err != nil {
		return 0, nil, "", false
	}
	if hasSub {
		n, err := strconv.ParseUint(subStr, 10, 32)
		if err != nil {
			return 0, nil, "", false
		}
		sub := uint32(n)
		subleaf = &sub
	}
	return uint32(l), subleaf, register, true
}

// cpuFeatureNames names the set bits of a feature word: QEMU's name for
// the feature where the table below has it, "bit N" otherwise.
func cpuFeatureNames(key string, set uint32) string {
	names := cpuidFeatureNames[key]
	var out []string
	for set != 0 {
		bit := bits.TrailingZeros32(set)
		set &^= 1 << bit
		if bit < len(names) && names[bit] != "" {
			out = append(out, fmt.Sprintf("%s (bit %d)", names[bit], bit))
		} else {
			out = append(out, fmt.Sprintf("bit %d", bit))
		}
	}
	return strings.Join(out, ", ")
}

// cpuidFeatureNames are QEMU's names (as in -cpu qemu64,+avx2) of the bits
// of the feature words that -cpu host differs in most, from QEMU 7.2's
// target/i386/cpu.c. Bits without a name there are left empty.
var cpuidFeatureNames = map[string][]string{
	"0x1:EDX": {"fpu", "vme", "de", "pse", "tsc", "msr", "pae", "mce",
		"cx8", "apic", "", "sep", "mtrr", "pge", "mca", "cmov",
		"pat", "pse36", "pn", "clflush", "", "ds", "acpi", "mmx",
		"fxsr", "sse", "sse2", "ss", "ht", "tm", "ia64", "pbe"},
	"0x1:ECX": {"pni", "pclmulqdq", "dtes64", "monitor", "ds-cpl", "vmx", "smx", "est",
		"tm2", "ssse3", "cid", "", "fma", "cx16", "xtpr", "pdcm",
		"", "pcid", "dca", "sse4.1", "sse4.2", "x2apic", "movbe", "popcnt",
		"tsc-deadline", "aes", "xsave", "", "avx", "f16c", "rdrand", "hypervisor"},
	"0x7.0:EBX": {"fsgsbase", "tsc-adjust", "sgx", "bmi1", "hle", "avx2", "", "smep",
		"bmi2", "erms", "invpcid", "rtm", "", "", "mpx", "",
		"avx512f", "avx512dq", "rdseed", "adx", "smap", "avx512ifma", "pcommit", "clflushopt",
		"clwb", "intel-pt", "avx512pf", "avx512er", "avx512cd", "sha-ni", "avx512bw", "avx512vl"},
	"0x7.0:ECX": {"", "avx512vbmi", "umip", "pku", "", "waitpkg", "avx512vbmi2", "",
		"gfni", "vaes", "vpclmulqdq", "avx512vnni", "avx512bitalg", "", "avx512-vpopcntdq", "",
		"la57", "", "", "", "", "", "rdpid", "",
		"bus-lock-detect", "cldemote", "", "movdiri", "movdir64b", "", "sgxlc", "pks"},
	"0x7.0:EDX": {"", "", "avx512-4vnniw", "avx512-4fmaps", "fsrm", "", "", "",
		"avx512-vp2intersect", "", "md-clear", "", "", "", "serialize", "",
		"tsx-ldtrk", "", "", "arch-lbr", "", "", "amx-bf16", "avx512-fp16",
		"amx-tile", "amx-int8", "spec-ctrl", "stibp", "flush-l1d", "arch-capabilities", "core-capability", "ssbd"},
	"0x80000001:ECX": {"lahf-lm", "cmp-legacy", "svm", "extapic", "cr8legacy", "abm", "sse4a", "misalignsse",
		"3dnowprefetch", "osvw", "ibs", "xop", "skinit", "wdt", "", "lwp",
		"fma4", "tce", "", "nodeid-msr", "", "tbm", "topoext", "perfctr-core",
		"perfctr-nb"},
	// Most low bits repeat leaf 1's EDX, as AMD defines them.
	"0x80000001:EDX": {"fpu", "vme", "de", "pse", "tsc", "msr", "pae", "mce",
		"cx8", "apic", "", "syscall", "mtrr", "pge", "mca", "cmov",
		"pat", "pse36", "", "", "nx", "", "mmxext", "mmx",
		"fxsr", "fxsr-opt", "pdpe1gb", "rdtscp", "", "lm", "3dnowext", "3dnow"},
	"0xd.1:EAX": {"xsaveopt", "xsavec", "xgetbv1", "xsaves", "xfd"},
	"0x6:EAX":   {"", "", "arat"},
}

type pciDevice struct {
	Bus      int    `json:"bus"`
	Slot     int    `json:"slot"`
	Function int    `json:"function"`
	QDevID   string `json:"qdev_id"`
	Class    struct {
		Class int `json:"class"`
	} `json:"class_info"`
	ID struct {
		Vendor int `json:"vendor"`
		Device int `json:"device"`
	} `json:"id"`
	PCIBridge *struct {
		Devices []pciDevice `json:"devices"`
	} `json:"pci_bridge"`
}

func readPCI(ctx context.Context, mon Executor) ([]string, error) {
	var buses []struct {
		Bus     int         `json:"bus"`
		Devices []pciDevice `json:"devices"`
	}
	if err := mon.Execute(ctx, "query-pci", nil, &buses); err != nil {
		return nil, err
	}
	var out []string
	var walk func([]pciDevice)
	walk = func(ds []pciDevice) {
		for _, d := range ds {
			s := fmt.Sprintf("%02x:%02x.%x %04x:%04x class=%04x", d.Bus, d.Slot, d.Function, d.ID.Vendor, d.ID.Device, d.Class.Class)
			if d.QDevID != "" {
				s += " id=" + d.QDevID
			}
			out = append(out, s)
			if d.PCIBridge != nil {
				walk(d.PCIBridge.Devices)
			}
		}
	}
	for _, b := range buses {
		walk(b.Devices)
	}
	slices.Sort(out)
	return out, nil
}

func devicesDigest(devices []string) string {
	h := sha256.New()
	for _, d := range devices {
		h.Write([]byte(d))
		h.Write([]byte{'\n'})
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil))
}

func readBlocks(ctx context.Context, mon Executor) ([]Block, error) {
	var infos []struct {
		Device   string `json:"device"`
		QDev     string `json:"qdev"`
		Inserted *struct {
			Drv   string `json:"drv"`
			RO    bool   `json:"ro"`
			Image struct {
				VirtualSize int64 `json:"virtual-size"`
			} `json:"image"`
		} `json:"inserted"`
	}
	if err := mon.Execute(ctx, "query-block", nil, &infos); err != nil {
		return nil, err
	}
	var out []Block
	for _, in := range infos {
		b := Block{Device: in.Device, QDev: in.QDev}
		if in.Inserted != nil {
			b.Format = in.Inserted.Drv
			b.ReadOnly = in.Inserted.RO
			b.VirtualSize = in.Inserted.Image.VirtualSize
		}
		out = append(out, b)
	}
	slices.SortFunc(out, func(a, b Block) int { return strings.Compare(a.Device+a.QDev, b.Device+b.QDev) })
	return out, nil
}

// Compare lists every way in which a QEMU described by target cannot load a
// stream saved from src. An empty list means the stream will load. QEMU
// loads streams from its own and older versions, so a newer target is fine.
func Compare(src, target Record) []string {
	var diffs []string
	differ := func(what, a, b string) {
		if a != b {
			diffs = append(diffs, fmt.Sprintf("%s: snapshot has %s, target has %s", what, quote(a), quote(b)))
		}
	}
	// Micro releases of one minor version load each other's streams (they
	// share machine types), so rolling back a micro update is fine.
	if cmpVersion(majorMinor(target.QEMUVersion), majorMinor(src.QEMUVersion)) < 0 {
		diffs = append(diffs, fmt.Sprintf("QEMU version: snapshot was taken by %s, target runs older %s (QEMU loads only streams from its own or older versions)", src.QEMUVersion, target.QEMUVersion))
	}
	differ("architecture", src.Arch, target.Arch)
	differ("machine type", src.Machine, target.Machine)
	differ("vCPU count", strconv.Itoa(src.CPUs), strconv.Itoa(target.CPUs))
	differ("CPU model", src.CPUModel, target.CPUModel)
	diffs = append(diffs, compareCPUFeatures(src, target)...)
	if src.MemoryBytes != target.MemoryBytes {
		diffs = append(diffs, fmt.Sprintf("memory: snapshot has %d MiB, target has %d MiB", src.MemoryBytes>>20, target.MemoryBytes>>20))
	}
	if src.DevicesHash != target.DevicesHash {
		for _, d := range setDiff(src.Devices, target.Devices) {
			diffs = append(diffs, "PCI device missing on target: "+d)
		}
		for _, d := range setDiff(target.Devices, src.Devices) {
			diffs = append(diffs, "PCI device not in snapshot: "+d)
		}
		if slices.Equal(src.Devices, target.Devices) {
			diffs = append(diffs, "PCI device list digest differs")
		}
	}
	if src.RAM != nil {
		switch {
		case target.RAM == nil:
			diffs = append(diffs, fmt.Sprintf("memory backend: snapshot's RAM is in backend %s, target names none (-machine memory-backend=%s)", quote(src.RAM.ID), src.RAM.ID))
		case target.RAM.ID != src.RAM.ID:
			differ("memory backend ID", src.RAM.ID, target.RAM.ID)
		}
	}
	diffs = append(diffs, compareVMGenID(src, target)...)
	srcBlocks := map[string]Block{}
	for _, b := range src.Blocks {
		srcBlocks[b.Device+"|"+b.QDev] = b
	}
	for _, t := range target.Blocks {
		key := t.Device + "|" + t.QDev
		s, ok := srcBlocks[key]
		if !ok {
			diffs = append(diffs, fmt.Sprintf("block device %s not in snapshot", blockName(t)))
			continue
		}
		delete(srcBlocks, key)
		differ("block device "+blockName(t)+" format", s.Format, t.Format)
		if s.VirtualSize != t.VirtualSize {
			diffs = append(diffs, fmt.Sprintf("block device %s size: snapshot has %d bytes, target has %d", blockName(t), s.VirtualSize, t.VirtualSize))
		}
		if s.ReadOnly != t.ReadOnly {
			diffs = append(diffs, fmt.Sprintf("block device %s read-only: snapshot %t, target %t", blockName(t), s.ReadOnly, t.ReadOnly))
		}
	}
	for _, s := range src.Blocks {
		if _, ok := srcBlocks[s.Device+"|"+s.QDev]; ok {
			diffs = append(diffs, fmt.Sprintf("block device %s missing on target", blockName(s)))
		}
	}
	return diffs
}

// CheckCompatible returns COMPAT_MISMATCH listing every difference, or nil.
func CheckCompatible(src, target Record) error {
	if diffs := Compare(src, target); len(diffs) > 0 {
		return errcode.WithDetails(errcode.CompatMismatch, diffs,
			"the waiting QEMU cannot load this snapshot (%d difference(s)); start it with the same machine, CPU, memory and devices as the source", len(diffs))
	}
	return nil
}

func blockName(b Block) string {
	if b.Device != "" {
		return b.Device
	}
	return b.QDev
}

func quote(s string) string {
	if s == "" {
		return "(none)"
	}
	return strconv.Quote(s)
}

func setDiff(a, b []string) []string {
	var out []string
	for _, x := range a {
		if !slices.Contains(b, x) {
			out = append(out, x)
		}
	}
	return out
}

func majorMinor(v string) string {
	parts := strings.SplitN(v, ".", 3)
	return strings.Join(parts[:min(len(parts), 2)], ".")
}

// cmpVersion compares dotted versions numerically; unparsable parts count as 0.
func cmpVersion(a, b string) int {
	pa, pb := strings.Split(a, "."), strings.Split(b, ".")
	for i := range max(len(pa), len(pb)) {
		var x, y int
		if i < len(pa) {
			x, _ = strconv.Atoi(pa[i])
		}
		if i < len(pb) {
			y, _ = strconv.Atoi(pb[i])
		}
		if x != y {
			return x - y
		}
	}
	return 0
}

// Validate checks a record read from an image before it is compared.
func (r Record) Validate() error {
	switch {
	case r.QEMUVersion == "" || r.Arch == "" || r.Machine == "":
		return errcode.New(errcode.InvalidInput, "compatibility record lacks the QEMU version, architecture or machine type")
	case r.CPUs <= 0 || r.CPUs > 4096:
		return errcode.New(errcode.InvalidInput, "compatibility record has %d vCPUs", r.CPUs)
	case r.MemoryBytes <= 0:
		return errcode.New(errcode.InvalidInput, "compatibility record has %d bytes of memory", r.MemoryBytes)
	case len(r.Devices) > 4096 || len(r.Blocks) > 4096:
		return errcode.New(errcode.InvalidInput, "compatibility record lists too many devices")
	case devicesDigest(r.Devices) != r.DevicesHash:
		return errcode.New(errcode.InvalidInput, "compatibility record's device digest does not match its device list")
	case len(r.CPUFeatures) > maxCPUIDWords || len(r.CPUFiltered) > maxCPUIDWords:
		return errcode.New(errcode.InvalidInput, "compatibility record lists too many CPUID feature words")
	case r.VMGenID != "" && !guidRE.MatchString(r.VMGenID):
		return errcode.New(errcode.InvalidInput, "compatibility record's VM generation ID %.48q is not a lower-case GUID", r.VMGenID)
	}
	for _, words := range []map[string]uint32{r.CPUFeatures, r.CPUFiltered} {
		for k := range words {
			if leaf, sub, reg, ok := parseCPUIDKey(k); !ok || cpuidKey(leaf, sub, reg) != k {
				return errcode.New(errcode.InvalidInput, "compatibility record names CPUID feature word %q: want LEAF[.SUBLEAF]:REGISTER, as in 0x7.0:EBX", k)
			}
		}
	}
	return nil
}

// maxCPUIDWords bounds the feature words of a record (QEMU 7.2 has 24).
const maxCPUIDWords = 256
