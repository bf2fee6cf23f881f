package ociimage

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
	//lint:ignore SA1019 a hostile header's raw coordinates are what is under test
	off := &ecdsa.PublicKey{Curve: elliptic.P256(), X: new(big.Int).Set(k.X), Y: new(big.Int).Add(k.Y, big.NewInt(1))}
	if onCurve(off) {
		t.Fatal("a point off P-256 passed as on the curve")
	}
	if onCurve(&ecdsa.PublicKey{Curve: elliptic.P256(), X: big.NewInt(0), Y: big.NewInt(0)}) {
		t.Fatal("the point (0, 0) passed as on P-256")
	}
}
