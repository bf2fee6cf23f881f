// Package imgcrypt encrypts and decrypts the layers of vmsnap's images in
// the OCI image encryption convention of containers/ocicrypt (what
// containerd's imgcrypt and skopeo read and write), as a wrapper of an
// ociimage.Repository: Encrypt stores every layer put through it
// encrypted (AES-256-CTR with HMAC-SHA256, a key per layer wrapped with
// JWE for each recipient) and rewrites the manifests to name the encrypted
// blobs; Decrypt reads encrypted layers as plaintext. WithEncryption and
// WithDecryptionKeys ask ociimage.Open for them.
//
// It owns: the encrypting repository (encrypt*.go) and the decrypting one
// (decrypt.go); the layer cipher (layercrypt.go); the JWE wrapping of
// layer keys with one CEK per checkpoint (jwe.go), their unwrapping behind
// a bounded cache of CEKs (jweunwrap.go, wrappedkey.go); the recipients
// and decryption keys and their files (keys.go); and what a manifest says
// about its encryption (recipients.go: EncryptedFor, LayersEncryptedFor,
// CheckDecrypted). The media type suffix and the
// annotation keys are ociimage's (mediatypes.go), as every other one.
//
// It must not return a byte of plaintext before the plaintext's digest has
// been checked, must not store a layer in the clear through an encrypting
// repository, and must not quote a key file's content. It knows nothing of
// where the images are stored: that is ociimage's, which in turn knows of
// encryption only its media types and annotations and the Wrapper that
// Open applies.
package imgcrypt
