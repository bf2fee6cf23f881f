package chunk

import (
	"slices"
	"testing"

	"github.com/vmsnap/vmsnap/internal/testing/chunkdata"
	"github.com/vmsnap/vmsnap/ociimage"
)

// cuts returns the chunk boundaries (end offsets) the chunker finds in b.
func cuts(ck chunker, b []byte) []int {
	var out []int
	for off := 0; off < len(b); {
		off += ck.cut(b[off:min(len(b), off+ck.max)])
		out = append(out, off)
	}
	return out
}

func TestChunkerSizes(t *testing.T) {
	ck := newChunker(64 << 10)
	if ck.min != 16<<10 || ck.avg != 64<<10 || ck.max != 96<<10 {
		t.Fatalf("newChunker(64 KiB) = %+v", ck)
	}
	if c := newChunker(100 << 10); c.avg != 64<<10 {
		t.Fatalf("newChunker(100 KiB) averages %d, want it rounded down to 64 KiB", c.avg)
	}
	b := chunkdata.Random(1, 16<<20)
	c := cuts(ck, b)
	prev, forced := 0, 0
	for i, end := range c {
		n := end - prev
		if n > ck.max || n < ck.min && i < len(c)-1 {
			t.Fatalf("chunk %d is %d bytes, outside %d..%d", i, n, ck.min, ck.max)
		}
		if n == ck.max {
			forced++
		}
		prev = end
	}
	// On random data the sizes center on the average, and most cuts are
	// placed by content, not length (seven in ten).
	mean := len(b) / len(c)
	if mean < ck.avg*7/8 || mean > ck.avg*9/8 {
		t.Fatalf("mean chunk %d bytes over %d chunks, want about %d", mean, len(c), ck.avg)
	}
	if forced*10 > len(c)*4 {
		t.Fatalf("%d of %d chunks end at max, want at most four in ten", forced, len(c))
	}
	// Data without boundaries (all zero) is cut at max.
	z := cuts(ck, make([]byte, 1<<20))
	if len(z) != (1<<20+ck.max-1)/ck.max || z[0] != ck.max {
		t.Fatalf("zero data cut at %v, want every %d bytes", z, ck.max)
	}
}

// The cut points after a change are those of the original, shifted by the
// change's length: boundaries depend on content, not on offsets.
func TestChunkerBoundariesSurviveInsertion(t *testing.T) {
	ck := newChunker(64 << 10)
	b := chunkdata.Random(2, 4<<20)
	before := cuts(ck, b)
	at, ins := len(b)/3, chunkdata.Random(3, 5000)
	after := cuts(ck, slices.Concat(b[:at], ins, b[at:]))
	shifted := map[int]bool{}
	for _, c := range before {
		if c > at {
			shifted[c+len(ins)] = true
		} else {
			shifted[c] = true
		}
	}
	differ := 0
	for _, c := range after {
		if !shifted[c] {
			differ++
		}
	}
	if differ > 2 {
		t.Fatalf("%d of %d boundaries moved after inserting %d bytes at %d; want at most 2", differ, len(after), len(ins), at)
	}
}

func BenchmarkChunker(b *testing.B) {
	ck := newChunker(4 << 20)
	data := chunkdata.Random(4, 64<<20)
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		cuts(ck, data)
	}
}

// referenceCut is the chunker's definition, one byte at a time; cut takes
// two bytes a step and must find the same cuts.
func referenceCut(c chunker, b []byte) int {
	n := min(len(b), c.max)
	if n <= c.min {
		return n
	}
	var h uint64
	for i := c.min - 64; i < n; i++ {
		h = h<<1 + gear[b[i]]
		mask := c.maskL
		if i < c.norm {
			mask = c.maskS
		}
		if i >= c.min && h&mask == 0 {
			return i + 1
		}
	}
	return n
}

func TestChunkerCutMatchesReference(t *testing.T) {
	b := chunkdata.Random(9, 8<<20)
	for _, avg := range []int{4 << 10, 8 << 10, 64 << 10} {
		ck := newChunker(avg)
		for off := 0; off < len(b); off += referenceCut(ck, b[off:]) {
			// Every length ends the scan somewhere else: odd and even,
			// inside and on either side of norm.
			for _, l := range []int{ck.max, ck.min + 1, ck.min + 2, ck.norm - 1, ck.norm, ck.norm + 1, ck.max - 1, len(b) - off} {
				l = min(l, len(b)-off)
				if got, want := ck.cut(b[off:off+l]), referenceCut(ck, b[off:off+l]); got != want {
					t.Fatalf("avg %d, %d bytes at %d: cut at %d, want %d", avg, l, off, got, want)
				}
			}
		}
	}
}

// The largest chunk the pipeline can make, incompressible, is still a
// chunk a store takes.
func TestLargestChunkIsStorable(t *testing.T) {
	ck := newChunker(EffectiveChunkSize(ociimage.MaxChunkSize))
	if n := maxEncodedSize(ck.max); n > ociimage.MaxChunkSize {
		t.Fatalf("chunks of up to %d bytes may compress to %d, over ociimage.MaxChunkSize (%d)", ck.max, n, ociimage.MaxChunkSize)
	}
}
