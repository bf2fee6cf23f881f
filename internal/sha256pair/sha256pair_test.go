package sha256pair

import (
	"crypto/hmac"
	"crypto/sha256"
	"math/rand/v2"
	"testing"
)

// want is what crypto/sha256 and crypto/hmac say of msg.
func want(key, msg []byte) (sum, mac [Size]byte) {
	sum = sha256.Sum256(msg)
	m := hmac.New(sha256.New, key)
	m.Write(msg)
	copy(mac[:], m.Sum(nil))
	return sum, mac
}

func check(t *testing.T, what string, key, msg []byte, d *DigestMAC) {
	t.Helper()
	sum, mac := d.Sums()
	wsum, wmac := want(key, msg)
	if sum != wsum || mac != wmac {
		t.Fatalf("%s (key %d bytes, message %d bytes): got %x / %x, want %x / %x", what, len(key), len(msg), sum, mac, wsum, wmac)
	}
}

// Every message length around the padding's edges (55, 56, 63, 64, 119,
// 120 bytes...), with keys shorter than, as long as and longer than a
// block, written in one piece.
func TestSumsMatchTheStandardLibrary(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	msg := make([]byte, 700)
	for i := range msg {
		msg[i] = byte(r.Uint32())
	}
	for _, kl := range []int{0, 1, 32, 64, 65, 200} {
		key := msg[100 : 100+kl]
		for n := 0; n <= len(msg); n++ {
			d := New(key)
			d.Write(msg[:n])
			check(t, "one write", key, msg[:n], d)
		}
	}
}

// A message written in random pieces (partial blocks, a block split across
// writes, empty writes) sums as the whole does, and Sums leaves the state
// as it was.
func TestPiecewiseWrites(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	key := []byte("a layer key of thirty-two bytes!")
	for range 200 {
		msg := make([]byte, r.IntN(5000))
		for i := range msg {
			msg[i] = byte(r.Uint32())
		}
		d := New(key)
		for off := 0; off < len(msg); {
			n := min(r.IntN(200), len(msg)-off)
			d.Write(msg[off : off+n])
			off += n
			if r.IntN(8) == 0 {
				check(t, "a prefix", key, msg[:off], d)
			}
		}
		check(t, "pieces", key, msg, d)
	}
}

// A large message, as a layer is: many blocks per call of the block
// function.
func TestLargeMessage(t *testing.T) {
	msg := make([]byte, 3<<20+17)
	for i := range msg {
		msg[i] = byte(i * 7)
	}
	key := make([]byte, 32)
	d := New(key)
	d.Write(msg[:1<<20])
	d.Write(msg[1<<20:])
	check(t, "3 MiB", key, msg, d)
}

// The fast path is the one tested when the CPU has it (it would silently
// be the fallback otherwise).
func TestFastPathWhereAvailable(t *testing.T) {
	if blockPair == nil {
		t.Skip("no SHA extensions here: the fallback (crypto/sha256, crypto/hmac) was tested")
	}
	if !New(nil).fast {
		t.Fatal("the CPU has the SHA extensions, but New took the fallback")
	}
}

// BenchmarkPair against BenchmarkTwoHashes is what the pair saves: its
// MB/s against crypto/sha256 and crypto/hmac over the same bytes, in the
// same run.
func BenchmarkPair(b *testing.B) {
	buf := make([]byte, 8<<20)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		d := New(buf[:32])
		d.Write(buf)
		d.Sums()
	}
}

func BenchmarkTwoHashes(b *testing.B) {
	buf := make([]byte, 8<<20)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		s, m := sha256.New(), hmac.New(sha256.New, buf[:32])
		s.Write(buf)
		m.Write(buf)
		s.Sum(nil)
		m.Sum(nil)
	}
}

// WithPlain's three sums are the standard library's, for every length
// around the padding's edges and for random pieces, the plaintext and the
// ciphertext being different messages.
func TestWithPlainMatchesTheStandardLibrary(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	key := []byte("another layer key, 32 bytes long")
	for n := 0; n <= 300; n++ {
		pt, ct := make([]byte, n), make([]byte, n)
		for i := range pt {
			pt[i], ct[i] = byte(r.Uint32()), byte(r.Uint32())
		}
		w := NewWithPlain(key)
		for off := 0; off < n; {
			k := min(r.IntN(150), n-off)
			w.Write2(pt[off:off+k], ct[off:off+k])
			off += k
		}
		psum, sum, mac := w.Sums()
		if psum != sha256.Sum256(pt) {
			t.Fatalf("%d bytes: plaintext digest %x, want %x", n, psum, sha256.Sum256(pt))
		}
		wsum, wmac := want(key, ct)
		if sum != wsum || mac != wmac {
			t.Fatalf("%d bytes: ciphertext %x / %x, want %x / %x", n, sum, mac, wsum, wmac)
		}
	}
	big := make([]byte, 2<<20+100)
	for i := range big {
		big[i] = byte(i * 13)
	}
	w := NewWithPlain(key)
	w.Write2(big[:1<<20], big[len(big)-1<<20:])
	psum, sum, mac := w.Sums()
	wsum, wmac := want(key, big[len(big)-1<<20:])
	if psum != sha256.Sum256(big[:1<<20]) || sum != wsum || mac != wmac {
		t.Fatal("1 MiB: the sums differ from the standard library's")
	}
}

func TestWithPlainFastPathWhereAvailable(t *testing.T) {
	if blockTriple == nil {
		t.Skip("no SHA extensions here: the fallback was tested")
	}
	if !NewWithPlain(nil).fast {
		t.Fatal("the CPU has the SHA extensions, but NewWithPlain took the fallback")
	}
}

// BenchmarkWithPlain against BenchmarkPair plus crypto/sha256's own rate:
// what hashing the plaintext in the same pass costs.
func BenchmarkWithPlain(b *testing.B) {
	buf := make([]byte, 8<<20)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		w := NewWithPlain(buf[:32])
		w.Write2(buf, buf)
		w.Sums()
	}
}

func BenchmarkPairThenPlain(b *testing.B) {
	buf := make([]byte, 8<<20)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		sha256.Sum256(buf)
		d := New(buf[:32])
		d.Write(buf)
		d.Sums()
	}
}
