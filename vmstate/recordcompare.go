package vmstate

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Compare lists every way in which a QEMU described by target cannot load a
// stream saved from src. An empty list means the stream will load. QEMU
// loads streams from its own and older versions, so a newer target is fine.
func Compare(src, target Record) []string {
	var diffs []string
	// Micro releases of one minor version load each other's streams (they
	// share machine types), so rolling back a micro update is fine.
	if cmpVersion(majorMinor(target.QEMUVersion), majorMinor(src.QEMUVersion)) < 0 {
		diffs = append(diffs, fmt.Sprintf("QEMU version: snapshot was taken by %s, target runs older %s (QEMU loads only streams from its own or older versions)", src.QEMUVersion, target.QEMUVersion))
	}
	diffs = differ(diffs, "architecture", src.Arch, target.Arch)
	diffs = differ(diffs, "machine type", src.Machine, target.Machine)
	diffs = differ(diffs, "vCPU count", strconv.Itoa(src.CPUs), strconv.Itoa(target.CPUs))
	diffs = differ(diffs, "CPU model", src.CPUModel, target.CPUModel)
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
			diffs = differ(diffs, "memory backend ID", src.RAM.ID, target.RAM.ID)
		}
	}
	diffs = append(diffs, compareVMGenID(src, target)...)
	return compareBlocks(diffs, src.Blocks, target.Blocks)
}

// differ adds to diffs that what differs, if a and b do.
func differ(diffs []string, what, a, b string) []string {
	if a == b {
		return diffs
	}
	return append(diffs, fmt.Sprintf("%s: snapshot has %s, target has %s", what, quote(a), quote(b)))
}

// compareBlocks adds to diffs how the target's block devices differ from
// the snapshot's: those of the target first, in its order, then those it
// lacks.
func compareBlocks(diffs []string, src, target []Block) []string {
	srcBlocks := map[string]Block{}
	for _, b := range src {
		srcBlocks[b.Device+"|"+b.QDev] = b
	}
	for _, t := range target {
		key := t.Device + "|" + t.QDev
		s, ok := srcBlocks[key]
		if !ok {
			diffs = append(diffs, fmt.Sprintf("block device %s not in snapshot", blockName(t)))
			continue
		}
		delete(srcBlocks, key)
		diffs = differ(diffs, "block device "+blockName(t)+" format", s.Format, t.Format)
		if s.VirtualSize != t.VirtualSize {
			diffs = append(diffs, fmt.Sprintf("block device %s size: snapshot has %d bytes, target has %d", blockName(t), s.VirtualSize, t.VirtualSize))
		}
		if s.ReadOnly != t.ReadOnly {
			diffs = append(diffs, fmt.Sprintf("block device %s read-only: snapshot %t, target %t", blockName(t), s.ReadOnly, t.ReadOnly))
		}
	}
	for _, s := range src {
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
