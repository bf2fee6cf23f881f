package main

import (
	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
)

// encryptFlags encrypt a checkpoint's layers. Keys are files, never flag
// values.
type encryptFlags struct {
	recipients []string
	dedupKey   string
}

func (f *encryptFlags) add(c *cobra.Command) {
	c.Flags().StringArrayVar(&f.recipients, "encrypt-recipient", nil,
		"encrypt the images' layers for `jwe:PUB.pem`, an RSA or EC public key (repeatable; any one recipient's private key decrypts; see docs/encryption-and-signing.md)")
	c.Flags().StringVar(&f.dedupKey, "encrypt-dedup-key", "",
		"with --encrypt-recipient: `FILE` of a secret (32+ random bytes, mode 0600) from which each chunk's key is derived, so that an unchanged chunk is not uploaded again; "+
			"reveals to registry readers which chunks are equal between checkpoints made with the same secret (default: a random key per chunk, every checkpoint uploads everything)")
}

func (f *encryptFlags) set() bool { return len(f.recipients) > 0 || f.dedupKey != "" }

// options reads the keys and returns the option that encrypts, or none.
func (f *encryptFlags) options() ([]ociimage.Option, error) {
	o, err := f.encryption()
	if o == nil || err != nil {
		return nil, err
	}
	return []ociimage.Option{imgcrypt.WithEncryption(*o)}, nil
}

// encryption reads the keys; nil without --encrypt-recipient.
func (f *encryptFlags) encryption() (*imgcrypt.EncryptOptions, error) {
	if !f.set() {
		return nil, nil
	}
	if len(f.recipients) == 0 {
		return nil, errcode.New(errcode.Usage, "--encrypt-dedup-key goes with --encrypt-recipient jwe:PUB.pem")
	}
	var o imgcrypt.EncryptOptions
	for _, r := range f.recipients {
		rc, err := imgcrypt.ParseRecipient(r)
		if err != nil {
			return nil, err
		}
		o.Recipients = append(o.Recipients, rc)
	}
	if f.dedupKey != "" {
		s, err := imgcrypt.LoadDedupSecret(f.dedupKey)
		if err != nil {
			return nil, err
		}
		o.DedupSecret = s
	}
	return &o, nil
}

// decryptFlags name the private keys that decrypt an encrypted image.
type decryptFlags struct {
	keys []string
}

func (f *decryptFlags) add(c *cobra.Command) {
	c.Flags().StringArrayVar(&f.keys, "decryption-key", nil,
		"`PATH` of a PEM private key (mode 0600 or stricter) that decrypts an encrypted image (repeatable; in a pod, a file of a mounted Secret)")
}

func (f *decryptFlags) options() ([]ociimage.Option, error) {
	var keys []imgcrypt.DecryptionKey
	for _, p := range f.keys {
		k, err := imgcrypt.LoadDecryptionKey(p)
		if err != nil {
			return nil, err
		}
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		return nil, nil
	}
	return []ociimage.Option{imgcrypt.WithDecryptionKeys(keys...)}, nil
}
