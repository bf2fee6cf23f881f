package vmstate

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/vmsnap/vmsnap/qmp"
)

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
	PCIBridge *pciBus `json:"pci_bridge"`
}

// pciBus is a bus of query-pci's answer, or the bus behind a bridge.
type pciBus struct {
	Devices []pciDevice `json:"devices"`
}

func readPCI(ctx context.Context, mon Executor) ([]string, error) {
	var buses []pciBus
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
