// Package sha256pair computes, in one pass over the data, the SHA-256
// digest of a byte stream and its HMAC-SHA256 under a key: the two hashes
// an encrypted layer needs of its ciphertext (its blob digest, and the
// HMAC of the OCI encryption convention). Both are SHA-256 over the same
// 64-byte blocks from different starting states (HMAC's inner hash starts
// after the key's block), so the message schedule is computed once and,
// on CPUs with the SHA extensions, the two round chains run interleaved:
// about the time of one SHA-256 pass for both, where two passes took
// twice that (latency-bound SHA-NI rounds on AMD Zen).
//
// It is not a general hash: one Pair per stream, read once with Sums.
package sha256pair

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding"
	"encoding/binary"
	"hash"
)

const (
	blockSize = 64
	// magic and layout of crypto/sha256's MarshalBinary state.
	magic         = "sha\x03"
	marshaledSize = len(magic) + 8*4 + blockSize + 8
)

// Pair hashes what is written to it with SHA-256 and HMAC-SHA256.
type Pair struct {
	key []byte
	// With SHA-NI: the two states, the bytes of a partial block and the
	// bytes hashed so far.
	h1, h2 [8]uint32
	buf    [blockSize]byte
	nbuf   int
	n      uint64
	// Without: two ordinary hashes.
	sha, mac hash.Hash
}

// New returns a Pair for HMAC key key (at most 64 bytes, as a layer key
// is).
func New(key []byte) *Pair {
	if len(key) > blockSize {
		panic("sha256pair: key longer than a block")
	}
	p := &Pair{key: append([]byte(nil), key...)}
	if !useSHANI {
		p.sha, p.mac = sha256.New(), hmac.New(sha256.New, key)
		return p
	}
	p.h1 = state(sha256.New())
	inner := sha256.New()
	inner.Write(pad(key, 0x36))
	p.h2 = state(inner)
	return p
}

// Write hashes b; it never fails.
func (p *Pair) Write(b []byte) (int, error) {
	if !useSHANI {
		p.sha.Write(b)
		p.mac.Write(b)
		return len(b), nil
	}
	n := len(b)
	p.n += uint64(n)
	if p.nbuf > 0 {
		c := copy(p.buf[p.nbuf:], b)
		p.nbuf += c
		b = b[c:]
		if p.nbuf < blockSize {
			return n, nil
		}
		blocksSHANI(&p.h1, &p.h2, p.buf[:])
		p.nbuf = 0
	}
	if full := len(b) &^ (blockSize - 1); full > 0 {
		blocksSHANI(&p.h1, &p.h2, b[:full])
		b = b[full:]
	}
	p.nbuf = copy(p.buf[:], b)
	return n, nil
}

// Sums returns the SHA-256 digest and the HMAC-SHA256 of what was written.
func (p *Pair) Sums() (digest, mac []byte) {
	if !useSHANI {
		return p.sha.Sum(nil), p.mac.Sum(nil)
	}
	digest = resume(p.h1, p.buf[:p.nbuf], p.n).Sum(nil)
	inner := resume(p.h2, p.buf[:p.nbuf], blockSize+p.n).Sum(nil)
	outer := sha256.New()
	outer.Write(pad(p.key, 0x5c))
	outer.Write(inner)
	return digest, outer.Sum(nil)
}

// pad is key zero-padded to a block and XORed with b (HMAC's ipad, opad).
func pad(key []byte, b byte) []byte {
	out := make([]byte, blockSize)
	copy(out, key)
	for i := range out {
		out[i] ^= b
	}
	return out
}

// state returns the chaining value of a SHA-256 hash that has consumed
// whole blocks only.
func state(h hash.Hash) (s [8]uint32) {
	b, err := h.(encoding.BinaryMarshaler).MarshalBinary()
	if err != nil || len(b) != marshaledSize {
		panic("sha256pair: unexpected crypto/sha256 state")
	}
	for i := range s {
		s[i] = binary.BigEndian.Uint32(b[len(magic)+4*i:])
	}
	return s
}

// resume returns a crypto/sha256 hash at chaining value s with the
// partial block tail pending, after n bytes in all.
func resume(s [8]uint32, tail []byte, n uint64) hash.Hash {
	b := make([]byte, 0, marshaledSize)
	b = append(b, magic...)
	for _, v := range s {
		b = binary.BigEndian.AppendUint32(b, v)
	}
	b = append(b, tail...)
	b = append(b, make([]byte, blockSize-len(tail))...)
	b = binary.BigEndian.AppendUint64(b, n)
	h := sha256.New()
	if err := h.(encoding.BinaryUnmarshaler).UnmarshalBinary(b); err != nil {
		panic("sha256pair: unexpected crypto/sha256 state: " + err.Error())
	}
	return h
}
