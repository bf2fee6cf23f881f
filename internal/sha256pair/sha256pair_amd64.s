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
#define SCHEDULE(M0, M1, M2, M3) SCHEDULE_T(M0, M1, M2, M3, X9)

#define SCHEDULE_T(M0, M1, M2, M3, tmp) \
	SHA256MSG1 M1, M0; \
	MOVO M3, tmp; \
	PALIGNR $4, M2, tmp; \
	PADDD tmp, M0; \
	SHA256MSG2 M3, M0

// (a,b,c,d) in lo and (e,f,g,h) in hi, as the state is in memory, to
// (A,B,E,F) in lo and (C,D,G,H) in hi, highest word first.
#define TO_ROUNDS(lo, hi, tmp) \
	PSHUFD $0xb1, lo, lo; \
	PSHUFD $0x1b, hi, hi; \
	MOVO lo, tmp; \
	PALIGNR $8, hi, lo; \
	PBLENDW $0xf0, tmp, hi

// The reverse of TO_ROUNDS.
#define FROM_ROUNDS(lo, hi, tmp) \
	PSHUFD $0x1b, lo, lo; \
	PSHUFD $0xb1, hi, hi; \
	MOVO lo, tmp; \
	PBLENDW $0xf0, hi, tmp; \
	PALIGNR $8, lo, hi; \
	MOVO tmp, lo

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
	TO_ROUNDS(X1, X2, X9)
	MOVOU 0(R8), X3
	MOVOU 16(R8), X4
	TO_ROUNDS(X3, X4, X9)

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

	FROM_ROUNDS(X1, X2, X9)
	MOVOU X1, 0(DI)
	MOVOU X2, 16(DI)
	FROM_ROUNDS(X3, X4, X9)
	MOVOU X3, 0(R8)
	MOVOU X4, 16(R8)

done:
	RET

// func blocks3(p, d, h *[8]uint32, pt, ct []byte, c *constants)
//
// blocks with a third state, p, over a second message of the same length:
// p over pt, d and h over ct (a plaintext's digest, and its ciphertext's
// digest and HMAC). Two schedules, three chains.
//
// Registers:
//	X1, X2 / X3, X4 / X5, X6   states p, d, h as SHA256RNDS2 takes them
//	X7-X10    pt's schedule; X11-X14 ct's
//	X0        W+K (or the byte-swap mask while the block loads)
//	X15       scratch
//	0-95(SP)  the states at the start of the block
//	DI, R8, R9  p, d, h; SI pt; R10 ct; DX blocks left; CX the constants

// Four rounds of p with pt's words MP, of d and h with ct's words MC.
#define ROUNDS4x3(koff, MP, MC) \
	MOVOU koff(CX), X0; \
	PADDD MP, X0; \
	SHA256RNDS2 X0, X1, X2; \
	PSHUFD $0x0e, X0, X0; \
	SHA256RNDS2 X0, X2, X1; \
	MOVOU koff(CX), X0; \
	PADDD MC, X0; \
	SHA256RNDS2 X0, X3, X4; \
	SHA256RNDS2 X0, X5, X6; \
	PSHUFD $0x0e, X0, X0; \
	SHA256RNDS2 X0, X4, X3; \
	SHA256RNDS2 X0, X6, X5

#define SCHEDULE2(P0, P1, P2, P3, C0, C1, C2, C3) \
	SCHEDULE_T(P0, P1, P2, P3, X15); \
	SCHEDULE_T(C0, C1, C2, C3, X15)

TEXT ·blocks3(SB), NOSPLIT, $96-80
	MOVQ p+0(FP), DI
	MOVQ d+8(FP), R8
	MOVQ h+16(FP), R9
	MOVQ pt_base+24(FP), SI
	MOVQ ct_base+48(FP), R10
	MOVQ ct_len+56(FP), DX
	MOVQ c+72(FP), CX
	SHRQ $6, DX
	JZ   done3

	MOVOU 0(DI), X1
	MOVOU 16(DI), X2
	TO_ROUNDS(X1, X2, X15)
	MOVOU 0(R8), X3
	MOVOU 16(R8), X4
	TO_ROUNDS(X3, X4, X15)
	MOVOU 0(R9), X5
	MOVOU 16(R9), X6
	TO_ROUNDS(X5, X6, X15)

loop3:
	MOVOU X1, 0(SP)
	MOVOU X2, 16(SP)
	MOVOU X3, 32(SP)
	MOVOU X4, 48(SP)
	MOVOU X5, 64(SP)
	MOVOU X6, 80(SP)

	MOVOU 256(CX), X0
	MOVOU 0(SI), X7
	PSHUFB X0, X7
	MOVOU 16(SI), X8
	PSHUFB X0, X8
	MOVOU 32(SI), X9
	PSHUFB X0, X9
	MOVOU 48(SI), X10
	PSHUFB X0, X10
	MOVOU 0(R10), X11
	PSHUFB X0, X11
	MOVOU 16(R10), X12
	PSHUFB X0, X12
	MOVOU 32(R10), X13
	PSHUFB X0, X13
	MOVOU 48(R10), X14
	PSHUFB X0, X14

	ROUNDS4x3(0, X7, X11)
	ROUNDS4x3(16, X8, X12)
	ROUNDS4x3(32, X9, X13)
	ROUNDS4x3(48, X10, X14)

	SCHEDULE2(X7, X8, X9, X10, X11, X12, X13, X14)
	ROUNDS4x3(64, X7, X11)
	SCHEDULE2(X8, X9, X10, X7, X12, X13, X14, X11)
	ROUNDS4x3(80, X8, X12)
	SCHEDULE2(X9, X10, X7, X8, X13, X14, X11, X12)
	ROUNDS4x3(96, X9, X13)
	SCHEDULE2(X10, X7, X8, X9, X14, X11, X12, X13)
	ROUNDS4x3(112, X10, X14)

	SCHEDULE2(X7, X8, X9, X10, X11, X12, X13, X14)
	ROUNDS4x3(128, X7, X11)
	SCHEDULE2(X8, X9, X10, X7, X12, X13, X14, X11)
	ROUNDS4x3(144, X8, X12)
	SCHEDULE2(X9, X10, X7, X8, X13, X14, X11, X12)
	ROUNDS4x3(160, X9, X13)
	SCHEDULE2(X10, X7, X8, X9, X14, X11, X12, X13)
	ROUNDS4x3(176, X10, X14)

	SCHEDULE2(X7, X8, X9, X10, X11, X12, X13, X14)
	ROUNDS4x3(192, X7, X11)
	SCHEDULE2(X8, X9, X10, X7, X12, X13, X14, X11)
	ROUNDS4x3(208, X8, X12)
	SCHEDULE2(X9, X10, X7, X8, X13, X14, X11, X12)
	ROUNDS4x3(224, X9, X13)
	SCHEDULE2(X10, X7, X8, X9, X14, X11, X12, X13)
	ROUNDS4x3(240, X10, X14)

	MOVOU 0(SP), X0
	PADDD X0, X1
	MOVOU 16(SP), X0
	PADDD X0, X2
	MOVOU 32(SP), X0
	PADDD X0, X3
	MOVOU 48(SP), X0
	PADDD X0, X4
	MOVOU 64(SP), X0
	PADDD X0, X5
	MOVOU 80(SP), X0
	PADDD X0, X6

	ADDQ $64, SI
	ADDQ $64, R10
	DECQ DX
	JNZ  loop3

	FROM_ROUNDS(X1, X2, X15)
	MOVOU X1, 0(DI)
	MOVOU X2, 16(DI)
	FROM_ROUNDS(X3, X4, X15)
	MOVOU X3, 0(R8)
	MOVOU X4, 16(R8)
	FROM_ROUNDS(X5, X6, X15)
	MOVOU X5, 0(R9)
	MOVOU X6, 16(R9)

done3:
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
