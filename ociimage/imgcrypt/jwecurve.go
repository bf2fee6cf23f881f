package imgcrypt

import "crypto/ecdsa"

// onCurve reports whether an ephemeral public key from a JWE header is a
// point of its curve: ECDH with a point off the curve would leak bits of
// the private key (an invalid-curve attack). crypto/ecdh checks the point
// when the key converts.
func onCurve(pub *ecdsa.PublicKey) bool {
	_, err := pub.ECDH()
	return err == nil
}
