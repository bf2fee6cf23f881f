// Package unhashed is the key to the stores' fetch that checks a blob's
// size but not its digest (Layout.BlobUnhashed, Registry.BlobUnhashed):
// for a reader that verifies the bytes itself, by other means, before it
// returns one (imgcrypt's decryption checks the plaintext's digest). Only
// packages beneath ociimage can name Key, so only they can make that call;
// to everyone else ociimage returns no byte it has not checked against its
// digest.
package unhashed

// Key is the argument that only packages beneath ociimage can give.
type Key struct{ _ struct{} }
