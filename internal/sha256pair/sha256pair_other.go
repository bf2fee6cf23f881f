//go:build !amd64 || purego

package sha256pair

// blockPair is nil: there is no fast path here, and DigestMAC uses
// crypto/sha256 and crypto/hmac.
var blockPair func(a, b *[8]uint32, p []byte)

var blockTriple func(p, d, h *[8]uint32, pt, ct []byte)
