package sha256pair

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"math/rand/v2"
	"testing"
)

// Every length around block boundaries, written in pieces of every shape,
// against crypto/sha256 and crypto/hmac.
func TestPairMatchesStdlib(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	data := make([]byte, 3000)
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	for _, key := range [][]byte{nil, []byte("k"), data[:32], data[100:164]} {
		for n := 0; n <= len(data); n += 1 + n/7 {
			for _, piece := range []int{1, 7, 63, 64, 65, 1000, n + 1} {
				p := New(key)
				for off := 0; off < n; off += piece {
					p.Write(data[off:min(off+piece, n)])
				}
				d, m := p.Sums()
				want := sha256.Sum256(data[:n])
				wm := hmac.New(sha256.New, key)
				wm.Write(data[:n])
				if !bytes.Equal(d, want[:]) || !bytes.Equal(m, wm.Sum(nil)) {
					t.Fatalf("key %d bytes, %d bytes in pieces of %d: sums differ from crypto/sha256 and crypto/hmac (SHA-NI: %v)", len(key), n, piece, useSHANI)
				}
			}
		}
	}
}

func BenchmarkPair(b *testing.B) {
	data := make([]byte, 8<<20)
	key := make([]byte, 32)
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		p := New(key)
		p.Write(data)
		p.Sums()
	}
}

// BenchmarkTwoPasses: what Pair replaces.
func BenchmarkTwoPasses(b *testing.B) {
	data := make([]byte, 8<<20)
	key := make([]byte, 32)
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		h, m := sha256.New(), hmac.New(sha256.New, key)
		h.Write(data)
		m.Write(data)
		h.Sum(nil)
		m.Sum(nil)
	}
}
