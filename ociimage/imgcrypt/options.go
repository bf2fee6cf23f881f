package imgcrypt

import "github.com/vmsnap/vmsnap/ociimage"

// WithEncryption has ociimage.Open encrypt every layer written (Encrypt),
// for a layout as for a registry.
func WithEncryption(e EncryptOptions) ociimage.Option {
	return ociimage.WithWrapper(crypt{encrypt: &e})
}

// WithDecryptionKeys has ociimage.Open read encrypted layers as plaintext
// with these keys (Decrypt), for a layout as for a registry. It may be
// given more than once.
func WithDecryptionKeys(keys ...DecryptionKey) ociimage.Option {
	return ociimage.WithWrapper(crypt{keys: keys})
}

// crypt is what the options ask of a repository Open opened: decrypted
// with keys, under encryption.
type crypt struct {
	encrypt *EncryptOptions
	keys    []DecryptionKey
}

// Wrap puts Encrypt directly above Decrypt, where encrypting.stored looks
// for the encrypted blobs of layers read through it.
func (c crypt) Wrap(repo ociimage.Repository) (ociimage.Repository, error) {
	if len(c.keys) > 0 {
		repo = Decrypt(repo, c.keys)
	}
	if c.encrypt != nil {
		return Encrypt(repo, *c.encrypt)
	}
	return repo, nil
}

// Merge adds later's keys to c's, and later's encryption replaces c's.
func (c crypt) Merge(later ociimage.Wrapper) ociimage.Wrapper {
	l, ok := later.(crypt)
	if !ok {
		return later
	}
	c.keys = append(append([]DecryptionKey(nil), c.keys...), l.keys...)
	if l.encrypt != nil {
		c.encrypt = l.encrypt
	}
	return c
}
