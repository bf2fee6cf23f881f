package snapshot

import (
	"crypto/rand"
	"testing"
)

// randomState is a VM state of n bytes, half random, half zeros (as the
// agent's tests make it).
func randomState(t testing.TB, n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b[:n/2])
	return b
}
