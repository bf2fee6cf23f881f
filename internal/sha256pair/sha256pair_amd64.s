//go:build amd64 && !purego

#include "textflag.h"

// func blocks(a, b *[8]uint32, p []byte, c *constants)
//
// Two SHA-256 states over the same 64-byte blocks, with the SHA extensions.
// Each block's words are loaded, byte-swapped and scheduled once; each
// W+K pair in X0 feeds both states' SHA256RNDS2, whose chains are
// independent, so one runs while the other waits on its latency.
//
// Registers:
//	X1, X2   state a as SHA256RNDS2 takes it: (A,B,E,F) and (C,D,G,H)
//	X3, X4   state b, likewise
//	X5-X8    the 16 message words of the schedule, four to a register
//	X0       W+K for the next four rounds (SHA256RNDS2's implicit operand)
//	X9       scratch
//	X10      the byte-swap mask
//	X11-X14  the states at the start of the block
//	DI, R8   a, b; SI the block; DX blocks left; CX the constants

// Four rounds of both states with message words M; koff is the offset of
// their constants. SHA256RNDS2 runs two rounds with the low two words of X0
// and leaves the new (A,B,E,F) in its destination, so the two registers of
// a state swap roles every two rounds and are back in place after four.
#define ROUNDS4(koff, M) \
	MOVOU koff(CX), X0; \
	PADDD M, X0; \
	SHA256RNDS2 X0, X1, X2; \
	SHA256RNDS2 X0, X3, X4; \
	PSHUFD $0x0e, X0, X0; \
	SHA256RNDS2 X0, X2, X1; \
	SHA256RNDS2 X0, X4, X3

// M = four big-endian words of the block at off.
#define LOAD(off, M) \
	MOVOU off(SI), M; \
	PSHUFB X10, M

// M0 = the next four words of the schedule, from the last sixteen (M0 the
// oldest): W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16].
// SHA256MSG1 adds the s0 terms, the PALIGNR gives W[t-7..t-4], SHA256MSG2
// adds the s1 terms (of the words it has just made, for the upper two).
#define SCHEDULE(M0, M1, M2, M3) \
	SHA256MSG1 M1, M0; \
	MOVO M3, X9; \
	PALIGNR $4, M2, X9; \
	PADDD X9, M0; \
	SHA256MSG2 M3, M0

// (a,b,c,d) in lo and (e,f,g,h) in hi, as the state is in memory, to
// (A,B,E,F) in lo and (C,D,G,H) in hi, highest word first.
#define TO_ROUNDS(lo, hi) \
	PSHUFD $0xb1, lo, lo; \
	PSHUFD $0x1b, hi, hi; \
	MOVO lo, X9; \
	PALIGNR $8, hi, lo; \
	PBLENDW $0xf0, X9, hi

// The reverse of TO_ROUNDS.
#define FROM_ROUNDS(lo, hi) \
	PSHUFD $0x1b, lo, lo; \
	PSHUFD $0xb1, hi, hi; \
	MOVO lo, X9; \
	PBLENDW $0xf0, hi, X9; \
	PALIGNR $8, lo, hi; \
	MOVO X9, lo

TEXT ·blocks(SB), NOSPLIT, $0-48
	MOVQ a+0(FP), DI
	MOVQ b+8(FP), R8
	MOVQ p_base+16(FP), SI
	MOVQ p_len+24(FP), DX
	MOVQ c+40(FP), CX
	SHRQ $6, DX
	JZ   done

	MOVOU 256(CX), X10
	MOVOU 0(DI), X1
	MOVOU 16(DI), X2
	TO_ROUNDS(X1, X2)
	MOVOU 0(R8), X3
	MOVOU 16(R8), X4
	TO_ROUNDS(X3, X4)

loop:
	MOVO X1, X11
	MOVO X2, X12
	MOVO X3, X13
	MOVO X4, X14

	LOAD(0, X5)
	ROUNDS4(0, X5)
	LOAD(16, X6)
	ROUNDS4(16, X6)
	LOAD(32, X7)
	ROUNDS4(32, X7)
	LOAD(48, X8)
	ROUNDS4(48, X8)

	SCHEDULE(X5, X6, X7, X8)
	ROUNDS4(64, X5)
	SCHEDULE(X6, X7, X8, X5)
	ROUNDS4(80, X6)
	SCHEDULE(X7, X8, X5, X6)
	ROUNDS4(96, X7)
	SCHEDULE(X8, X5, X6, X7)
	ROUNDS4(112, X8)

	SCHEDULE(X5, X6, X7, X8)
	ROUNDS4(128, X5)
	SCHEDULE(X6, X7, X8, X5)
	ROUNDS4(144, X6)
	SCHEDULE(X7, X8, X5, X6)
	ROUNDS4(160, X7)
	SCHEDULE(X8, X5, X6, X7)
	ROUNDS4(176, X8)

	SCHEDULE(X5, X6, X7, X8)
	ROUNDS4(192, X5)
	SCHEDULE(X6, X7, X8, X5)
	ROUNDS4(208, X6)
	SCHEDULE(X7, X8, X5, X6)
	ROUNDS4(224, X7)
	SCHEDULE(X8, X5, X6, X7)
	ROUNDS4(240, X8)

	PADDD X11, X1
	PADDD X12, X2
	PADDD X13, X3
	PADDD X14, X4

	ADDQ $64, SI
	DECQ DX
	JNZ  loop

	FROM_ROUNDS(X1, X2)
	MOVOU X1, 0(DI)
	MOVOU X2, 16(DI)
	FROM_ROUNDS(X3, X4)
	MOVOU X3, 0(R8)
	MOVOU X4, 16(R8)

done:
	RET

// func cpuid(leaf, sub uint32) (eax, ebx, ecx, edx uint32)
TEXT ·cpuid(SB), NOSPLIT, $0-24
	MOVL leaf+0(FP), AX
	MOVL sub+4(FP), CX
	CPUID
	MOVL AX, eax+8(FP)
	MOVL BX, ebx+12(FP)
	MOVL CX, ecx+16(FP)
	MOVL DX, edx+20(FP)
	RET
