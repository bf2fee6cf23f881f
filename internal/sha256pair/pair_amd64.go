//go:build amd64 && !purego

package sha256pair

import "golang.org/x/sys/cpu"

//go:noescape
func blocksSHANI(h1, h2 *[8]uint32, p []byte)

func cpuid(eaxArg, ecxArg uint32) (eax, ebx, ecx, edx uint32)

// useSHANI: the SHA extensions (CPUID.7.0:EBX bit 29) and the SSE4.1 and
// SSSE3 instructions the block function also uses.
var useSHANI = func() bool {
	if !cpu.X86.HasSSE41 || !cpu.X86.HasSSSE3 {
		return false
	}
	if max, _, _, _ := cpuid(0, 0); max < 7 {
		return false
	}
	_, ebx, _, _ := cpuid(7, 0)
	return ebx&(1<<29) != 0
}()
