package vmstate

import "math/bits"

// Chunk boundaries are content-defined: a cut falls where a rolling hash of
// the last 64 bytes has its top bits zero, so it depends on those bytes
// alone and not on where they sit in the stream. A change in the VM's
// memory then alters only the chunks around it, even when it makes the
// stream longer or shorter (a zero page that became data adds 4 KiB); the
// chunks before and after it keep their digests and the store already has
// them. Fixed-size chunks would shift after the first insertion and upload
// everything behind it again.
//
// The hash is a gear hash (as in FastCDC): h = h<<1 + gear[byte]. After 64
// steps a byte's contribution has been shifted out, so the window is 64
// bytes. Normalized chunking keeps sizes near the average: below it a cut
// needs one more zero bit, above it one fewer. Cuts are never closer than
// min or further apart than max.

// chunker finds content-defined cut points.
type chunker struct {
	min, avg, max int
	maskS, maskL  uint64 // below avg, from avg on
}

// newChunker makes a chunker for chunks of about avg bytes, between avg/2
// and 3*avg/2. avg is rounded down to a power of two of at least 4 KiB.
// (A tighter max keeps the pipeline's buffers small; about a third of the
// chunks end at max, and the next content-defined cut resynchronizes.)
func newChunker(avg int) chunker {
	avg = max(avg, 4<<10)
	b := bits.Len(uint(avg)) - 1 // log2, rounded down
	avg = 1 << b
	return chunker{
		min:   avg / 2,
		avg:   avg,
		max:   avg + avg/2,
		maskS: topBits(b + 1),
		maskL: topBits(b - 1),
	}
}

// topBits is a mask of the n highest bits: they depend on the most bytes
// of the window.
func topBits(n int) uint64 { return ^uint64(0) << (64 - n) }

// cut returns the length of the first chunk of b. b holds at most c.max
// bytes; if it holds fewer, they are the end of the stream, and without a
// boundary in them they are one chunk.
func (c chunker) cut(b []byte) int {
	n := min(len(b), c.max)
	if n <= c.min {
		return n
	}
	// Warm the hash up on the 64 bytes before min, so that a cut right at
	// min depends on a full window like any other.
	var h uint64
	i := c.min - 64
	for ; i < c.min; i++ {
		h = h<<1 + gear[b[i]]
	}
	for end := min(c.avg, n); i < end; i++ {
		h = h<<1 + gear[b[i]]
		if h&c.maskS == 0 {
			return i + 1
		}
	}
	for ; i < n; i++ {
		h = h<<1 + gear[b[i]]
		if h&c.maskL == 0 {
			return i + 1
		}
	}
	return n
}

// gear holds 256 fixed pseudo-random words. They are part of what makes two
// checkpoints share chunks: changing them changes every cut point (never
// correctness, only deduplication against older snapshots).
var gear = func() (t [256]uint64) {
	x := uint64(0x766d736e61703031) // "vmsnap01"
	for i := range t {
		// splitmix64
		x += 0x9e3779b97f4a7c15
		z := x
		z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		t[i] = z ^ z>>31
	}
	return t
}()
