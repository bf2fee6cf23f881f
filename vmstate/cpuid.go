package vmstate

import (
	_ "embed"
	"fmt"
	"math/bits"
	"strconv"
	"strings"
)

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

// cpuidFeatureNames are QEMU's names of the bits of the feature words
// that -cpu host differs in most (cpuidnames.txt), by cpuidKey: bits
// without a name there are left empty.
var cpuidFeatureNames = parseCPUIDNames(cpuidNamesText)

//go:embed cpuidnames.txt
var cpuidNamesText string

// parseCPUIDNames reads cpuidnames.txt: a line per feature word, its key
// and then its bits' names from bit 0 on ("-" for none); "#" lines are
// comments.
func parseCPUIDNames(text string) map[string][]string {
	out := map[string][]string{}
	for line := range strings.Lines(text) {
		fields := strings.Fields(line)
		if len(fields) == 0 || strings.HasPrefix(fields[0], "#") {
			continue
		}
		names := fields[1:]
		for i, n := range names {
			if n == "-" {
				names[i] = ""
			}
		}
		out[fields[0]] = names
	}
	return out
}
