package imgcrypt

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"math/big"
	"testing"
)

// An ephemeral key whose point is off its curve is refused before any ECDH
// with the recipient's private key; a real one passes.
func TestOnCurveRefusesAPointOffTheCurve(t *testing.T) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	if !onCurve(&k.PublicKey) {
		t.Fatal("a generated P-256 key is not on its curve")
	}
	raw, err := k.PublicKey.Bytes() // 0x04 || X || Y
	if err != nil {
		t.Fatal(err)
	}
	x, y := new(big.Int).SetBytes(raw[1:33]), new(big.Int).SetBytes(raw[33:])
	if onCurve(rawPoint(x, new(big.Int).Add(y, big.NewInt(1)))) {
		t.Fatal("a point off P-256 passed as on the curve")
	}
	if onCurve(rawPoint(big.NewInt(0), big.NewInt(0))) {
		t.Fatal("the point (0, 0) passed as on P-256")
	}
}

// rawPoint is a P-256 public key with the coordinates a hostile JWE header
// could carry.
func rawPoint(x, y *big.Int) *ecdsa.PublicKey {
	//lint:ignore SA1019 raw coordinates are what a hostile header carries
	return &ecdsa.PublicKey{Curve: elliptic.P256(), X: x, Y: y}
}
