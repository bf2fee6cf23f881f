package main

import (
	"os"

	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// envCosignPassword is where cosign, and vmsnap, take the password of an
// encrypted signing key from.
const envCosignPassword = "COSIGN_PASSWORD"

// signFlags sign a checkpoint's manifests. The password is never a flag
// value: it comes from COSIGN_PASSWORD or a file.
type signFlags struct {
	key, passwordFile string
}

func (f *signFlags) add(c *cobra.Command) {
	c.Flags().StringVar(&f.key, "sign-key", "",
		"sign every manifest with the private key in `FILE`, as cosign sign --key does (signature at the tag sha256-HEX.sig): "+
			"cosign generate-key-pair's cosign.key (its password from $COSIGN_PASSWORD or --sign-key-password-file) or a plain PEM EC or RSA key; mode 0600")
	c.Flags().StringVar(&f.passwordFile, "sign-key-password-file", "",
		"`FILE` (mode 0600) holding the password of an encrypted --sign-key, instead of $COSIGN_PASSWORD")
}

func (f *signFlags) set() bool { return f.key != "" || f.passwordFile != "" }

// options reads the key and returns the option that signs, or none.
func (f *signFlags) options() ([]ociimage.Option, error) {
	if !f.set() {
		return nil, nil
	}
	if f.key == "" {
		return nil, errcode.New(errcode.Usage, "--sign-key-password-file goes with --sign-key FILE")
	}
	k, err := loadSignKey(f.key, f.passwordFile)
	if err != nil {
		return nil, err
	}
	return []ociimage.Option{ociimage.WithSigner(k)}, nil
}

// loadSignKey reads a signing key, its password from passwordFile if
// given, else from COSIGN_PASSWORD if set (an empty password is one).
func loadSignKey(key, passwordFile string) (ociimage.SignKey, error) {
	var password []byte
	if passwordFile != "" {
		p, err := ociimage.ReadPasswordFile(passwordFile)
		if err != nil {
			return ociimage.SignKey{}, err
		}
		password = p
	} else if p, ok := os.LookupEnv(envCosignPassword); ok {
		password = []byte(p)
	}
	defer clear(password)
	return ociimage.LoadSignKey(key, password)
}

// verifyFlags name the public keys whose signatures a restore accepts.
type verifyFlags struct {
	keys []string
}

func (f *verifyFlags) add(c *cobra.Command) {
	c.Flags().StringArrayVar(&f.keys, "verify-key", nil,
		"accept only an image signed, as cosign sign --key does, by the PEM public key in `FILE` (cosign.pub; repeatable: any one key's signature suffices); "+
			"checked before anything else is read, an unsigned or wrongly signed image is AUTH_FAILED")
}

// options reads the keys and returns the option that verifies, or none.
func (f *verifyFlags) options() ([]ociimage.Option, error) {
	var keys []ociimage.VerifyKey
	for _, p := range f.keys {
		k, err := ociimage.LoadVerifyKey(p)
		if err != nil {
			return nil, err
		}
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		return nil, nil
	}
	return []ociimage.Option{ociimage.WithVerifyKeys(keys...)}, nil
}

// agentSignFlags: the agent signs every checkpoint with the operator's key,
// and requires signatures of what restores read.
type agentSignFlags struct {
	sign    signFlags
	verify  verifyFlags
	require []string
}

func (f *agentSignFlags) add(c *cobra.Command) {
	f.sign.add(c)
	c.Flags().StringArrayVar(&f.verify.keys, "verify-key", nil,
		"every image a restore or prepare reads must be signed, as cosign sign --key does, by one of these PEM public keys (`FILE`, repeatable)")
	c.Flags().StringArrayVar(&f.require, "require-signature", nil,
		"`HOST[:PORT]/PREFIX=KEY`: images of the repositories under PREFIX (as in --allow-repository, {namespace} included) must be signed by KEY, "+
			"a PEM public key file, or by another key that applies (repeatable)")
}

// apply reads the keys into cfg and returns the option that signs, or none.
func (f *agentSignFlags) apply(cfg *agent.Config) ([]ociimage.Option, error) {
	for _, p := range f.verify.keys {
		k, err := ociimage.LoadVerifyKey(p)
		if err != nil {
			return nil, err
		}
		cfg.VerifyKeys = append(cfg.VerifyKeys, k)
	}
	cfg.RequireSignatures = f.require
	return f.sign.options()
}
