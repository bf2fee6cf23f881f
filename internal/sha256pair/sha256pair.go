// Package sha256pair computes the two hashes an encrypted layer needs of its
// ciphertext in one pass: its SHA-256 (the blob digest) and its
// HMAC-SHA256 (the OCI image encryption convention's integrity tag); and,
// with WithPlain, its plaintext's SHA-256 in the same pass.
//
// Both are SHA-256 over the same message from different starting states
// (the HMAC's inner hash starts after its key block), so each message block
// is loaded and scheduled once and fed to two round chains. On amd64 with
// the SHA extensions the two chains run interleaved (sha256pair_amd64.s),
// which costs about what one hash does: a single chain is bound by the
// latency of the round instruction, not by its throughput (a third chain,
// over the plaintext's own schedule, fits in the same way). Elsewhere it
// falls back to crypto/sha256 and crypto/hmac.
//
// Use: New(key), Write(ct), Sums() (digest, MAC); NewWithPlain(key),
// Write2(plain, ct), Sums() (plaintext digest, ciphertext digest, MAC).
// -tags purego or another architecture takes the fallback.
//
// It is not a general hash package (use crypto/sha256), nor a MAC check
// (use crypto/hmac's Equal on what Sums returns): the only caller is
// imgcrypt's encrypting store.
package sha256pair

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"hash"
)

// Size is the length of both sums.
const Size = sha256.Size

const blockSize = sha256.BlockSize

// DigestMAC hashes a message twice at once: SHA-256 and HMAC-SHA256 under
// one key. Write never fails.
type DigestMAC struct {
	fast bool
	// the fast path
	dig, inner [8]uint32 // the two chains' states
	outer      [blockSize]byte
	buf        [blockSize]byte
	nbuf       int
	n          uint64 // message bytes written
	// the fallback
	sha, mac hash.Hash
}

// New returns a DigestMAC whose MAC is keyed with key.
func New(key []byte) *DigestMAC {
	if blockPair == nil {
		return &DigestMAC{sha: sha256.New(), mac: hmacSHA256(key)}
	}
	d := &DigestMAC{fast: true, dig: iv, inner: iv}
	// HMAC (RFC 2104): a key longer than a block is hashed first; the inner
	// hash starts with the key XOR ipad, the outer with key XOR opad.
	var k [blockSize]byte
	if len(key) > blockSize {
		s := sha256.Sum256(key)
		copy(k[:], s[:])
	} else {
		copy(k[:], key)
	}
	var ipad [blockSize]byte
	for i := range k {
		ipad[i] = k[i] ^ 0x36
		d.outer[i] = k[i] ^ 0x5c
	}
	var scratch [8]uint32
	blockPair(&d.inner, &scratch, ipad[:])
	return d
}

// Write adds p to the message.
func (d *DigestMAC) Write(p []byte) (int, error) {
	if !d.fast {
		d.sha.Write(p)
		return d.mac.Write(p)
	}
	n := len(p)
	d.n += uint64(n)
	if d.nbuf > 0 {
		c := copy(d.buf[d.nbuf:], p)
		d.nbuf += c
		p = p[c:]
		if d.nbuf < blockSize {
			return n, nil
		}
		blockPair(&d.dig, &d.inner, d.buf[:])
		d.nbuf = 0
	}
	if full := len(p) &^ (blockSize - 1); full > 0 {
		blockPair(&d.dig, &d.inner, p[:full])
		p = p[full:]
	}
	d.nbuf = copy(d.buf[:], p)
	return n, nil
}

// Sums returns the message's SHA-256 and its HMAC-SHA256. It does not
// change d.
func (d *DigestMAC) Sums() (sum, mac [Size]byte) {
	if !d.fast {
		copy(sum[:], d.sha.Sum(nil))
		copy(mac[:], d.mac.Sum(nil))
		return sum, mac
	}
	// The two chains end with the same bytes and the same amount of
	// padding (it depends on len mod 64 alone), but not the same length
	// field: the inner hash's counts its key block too. So only the last
	// block differs.
	dig, inner := d.dig, d.inner
	tail, tailInner := pad(d.buf[:d.nbuf], d.n), pad(d.buf[:d.nbuf], d.n+blockSize)
	if len(tail) > blockSize {
		blockPair(&dig, &inner, tail[:blockSize])
	}
	var scratch [8]uint32
	blockPair(&dig, &scratch, tail[len(tail)-blockSize:])
	blockPair(&inner, &scratch, tailInner[len(tail)-blockSize:])
	sum = words(dig)
	in := words(inner)
	o := sha256.New()
	o.Write(d.outer[:])
	o.Write(in[:])
	copy(mac[:], o.Sum(nil))
	return sum, mac
}

// pad returns the last bytes of a message of n bytes, rest, with SHA-256's
// padding: a 1 bit, zeros, and the length in bits, to a whole number of
// blocks.
func pad(rest []byte, n uint64) []byte {
	l := len(rest) + 1 + 8
	l = (l + blockSize - 1) &^ (blockSize - 1)
	b := make([]byte, l)
	copy(b, rest)
	b[len(rest)] = 0x80
	binary.BigEndian.PutUint64(b[l-8:], n*8)
	return b
}

func words(s [8]uint32) (out [Size]byte) {
	for i, w := range s {
		binary.BigEndian.PutUint32(out[4*i:], w)
	}
	return out
}

// iv is SHA-256's initial state (FIPS 180-4, 5.3.3).
var iv = [8]uint32{
	0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
	0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
}

func hmacSHA256(key []byte) hash.Hash { return hmac.New(sha256.New, key) }
