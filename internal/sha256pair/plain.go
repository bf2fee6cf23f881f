package sha256pair

import (
	"crypto/sha256"
	"hash"
)

// WithPlain is a DigestMAC of a ciphertext that also hashes its plaintext,
// written alongside it: the three hashes an encrypted layer needs (its
// plaintext digest, its blob digest, its HMAC) in one pass over both.
type WithPlain struct {
	DigestMAC
	plain [8]uint32
	pbuf  [blockSize]byte
	sha   hash.Hash // the fallback's
}

// NewWithPlain returns a WithPlain whose MAC is keyed with key.
func NewWithPlain(key []byte) *WithPlain {
	w := &WithPlain{DigestMAC: *New(key), plain: iv}
	if !w.fast || blockTriple == nil {
		w.fast = false
		w.DigestMAC = DigestMAC{sha: sha256.New(), mac: hmacSHA256(key)}
		w.sha = sha256.New()
	}
	return w
}

// Write2 adds plain to the plaintext and ct, its ciphertext (as long), to
// the ciphertext.
func (w *WithPlain) Write2(plain, ct []byte) {
	if len(plain) != len(ct) {
		panic("sha256pair: a plaintext and a ciphertext of different lengths")
	}
	if !w.fast {
		w.sha.Write(plain)
		w.DigestMAC.Write(ct)
		return
	}
	w.n += uint64(len(ct))
	if w.nbuf > 0 {
		copy(w.pbuf[w.nbuf:], plain)
		c := copy(w.buf[w.nbuf:], ct)
		w.nbuf += c
		plain, ct = plain[c:], ct[c:]
		if w.nbuf < blockSize {
			return
		}
		blockTriple(&w.plain, &w.dig, &w.inner, w.pbuf[:], w.buf[:])
		w.nbuf = 0
	}
	if full := len(ct) &^ (blockSize - 1); full > 0 {
		blockTriple(&w.plain, &w.dig, &w.inner, plain[:full], ct[:full])
		plain, ct = plain[full:], ct[full:]
	}
	copy(w.pbuf[:], plain)
	w.nbuf = copy(w.buf[:], ct)
}

// Sums returns the plaintext's SHA-256, and the ciphertext's SHA-256 and
// HMAC-SHA256. It does not change w.
func (w *WithPlain) Sums() (plainSum, sum, mac [Size]byte) {
	sum, mac = w.DigestMAC.Sums()
	if !w.fast {
		copy(plainSum[:], w.sha.Sum(nil))
		return plainSum, sum, mac
	}
	p := w.plain
	tail := pad(w.pbuf[:w.nbuf], w.n)
	var scratch [8]uint32
	blockPair(&p, &scratch, tail)
	return words(p), sum, mac
}
