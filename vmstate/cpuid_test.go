package vmstate

import "testing"

// TestCPUIDNamesTable checks cpuidnames.txt as the compatibility check
// reads it: every word a key cpuidKey writes, no word over 32 bits, and the
// names QEMU 7.2's table gives at the bits a typo or a lost "-" would
// shift (each row's last bit, its first unnamed bits, AMD's own EDX bits).
func TestCPUIDNamesTable(t *testing.T) {
	if len(cpuidFeatureNames) != 9 {
		t.Fatalf("the table has %d feature words, want 9", len(cpuidFeatureNames))
	}
	for k, names := range cpuidFeatureNames {
		if leaf, sub, reg, ok := parseCPUIDKey(k); !ok || cpuidKey(leaf, sub, reg) != k {
			t.Errorf("word %q is not a cpuidKey", k)
		}
		if len(names) > 32 {
			t.Errorf("word %s names %d bits", k, len(names))
		}
	}
	for _, c := range []struct {
		key  string
		bit  int
		want string
	}{
		{"0x1:EDX", 0, "fpu"}, {"0x1:EDX", 10, ""}, {"0x1:EDX", 31, "pbe"},
		{"0x1:ECX", 27, ""}, {"0x1:ECX", 31, "hypervisor"},
		{"0x7.0:EBX", 12, ""}, {"0x7.0:EBX", 31, "avx512vl"},
		{"0x7.0:ECX", 0, ""}, {"0x7.0:ECX", 22, "rdpid"}, {"0x7.0:ECX", 31, "pks"},
		{"0x7.0:EDX", 0, ""}, {"0x7.0:EDX", 31, "ssbd"},
		{"0x80000001:ECX", 24, "perfctr-nb"},
		{"0x80000001:EDX", 11, "syscall"}, {"0x80000001:EDX", 19, ""}, {"0x80000001:EDX", 20, "nx"}, {"0x80000001:EDX", 31, "3dnow"},
		{"0xd.1:EAX", 4, "xfd"}, {"0x6:EAX", 0, ""}, {"0x6:EAX", 2, "arat"},
	} {
		names := cpuidFeatureNames[c.key]
		got := "(past the word's last name)"
		if c.bit < len(names) {
			got = names[c.bit]
		}
		if got != c.want {
			t.Errorf("%s bit %d: got %q, want %q", c.key, c.bit, got, c.want)
		}
	}
	if got, want := cpuFeatureNames("0x6:EAX", 1<<2|1<<5), "arat (bit 2), bit 5"; got != want {
		t.Errorf("cpuFeatureNames: got %q, want %q", got, want)
	}
}
