//go:build amd64 && !purego

package sha256pair

// blockPair runs both states over every 64-byte block of p (a whole number
// of blocks); nil where there is no fast path.
var blockPair func(a, b *[8]uint32, p []byte)

// blockTriple runs p over the blocks of pt, and d and h over those of ct
// (as long as pt); nil where there is no fast path.
var blockTriple func(p, d, h *[8]uint32, pt, ct []byte)

func init() {
	// The SHA extensions, and PSHUFB (SSSE3) and PBLENDW (SSE4.1) to move
	// words between their layout and the state's.
	// (golang.org/x/sys/cpu does not report SHA, so CPUID is asked here.)
	maxLeaf, _, _, _ := cpuid(0, 0)
	if maxLeaf < 7 {
		return
	}
	_, _, ecx1, _ := cpuid(1, 0)
	_, ebx7, _, _ := cpuid(7, 0)
	sha, ssse3, sse41 := ebx7&(1<<29) != 0, ecx1&(1<<9) != 0, ecx1&(1<<19) != 0
	if sha && ssse3 && sse41 {
		blockPair = func(a, b *[8]uint32, p []byte) { blocks(a, b, p, &consts) }
		blockTriple = func(p, d, h *[8]uint32, pt, ct []byte) { blocks3(p, d, h, pt, ct, &consts) }
	}
}

// cpuid is the CPUID instruction (sha256pair_amd64.s).
func cpuid(leaf, sub uint32) (eax, ebx, ecx, edx uint32)

// blocks is blockPair in assembly (sha256pair_amd64.s).
//
//go:noescape
func blocks(a, b *[8]uint32, p []byte, c *constants)

// blocks3 is blockTriple in assembly.
//
//go:noescape
func blocks3(p, d, h *[8]uint32, pt, ct []byte, c *constants)

type constants struct {
	k    [64]uint32 // the round constants
	flip [16]byte   // PSHUFB mask: each 32-bit word from big- to little-endian
}

var consts = constants{
	k: [64]uint32{ // FIPS 180-4, 4.2.2
		0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
		0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
		0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
		0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
		0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
		0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
		0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
		0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
	},
	flip: [16]byte{3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12},
}
