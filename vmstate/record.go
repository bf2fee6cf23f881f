package vmstate

import (
	"context"
	"crypto/sha256"
	"encoding/hex"

	"github.com/vmsnap/vmsnap/internal/errcode"
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

func devicesDigest(devices []string) string {
	h := sha256.New()
	for _, d := range devices {
		h.Write([]byte(d))
		h.Write([]byte{'\n'})
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil))
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
