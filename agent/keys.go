package agent

// Who may decrypt what, and what a checkpoint is encrypted for.
//
// The plaintext of an encrypted image lands in a namespace: the VM a
// restore feeds, the RAM cache a prepare fills, the VM whose memory-file
// delta reads its parent. So an operation decrypts with the keys of that
// namespace (keydir.go: DIR/NS) and, for an admin caller, the node's too
// (the files directly in DIR). A caller in a pod never uses another
// namespace's keys or the node's: tenant A that copies tenant B's
// encrypted checkpoint into its own repository and restores it into its
// own VM gets AUTH_FAILED, as a restore without the key would.
//
// A checkpoint of a VM in namespace NS is encrypted for the agent's
// --encrypt-recipient keys (node-wide: keep their private keys in the
// node's set, so that only admins can restore with them) and for the
// public half of each of NS's keys: what the agent checkpoints for a
// namespace, that namespace can restore. With neither, it is plaintext.

import (
	"context"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
)

// storeFor is the store options of an operation of the request's caller
// about namespace ns (its VM's, or the RAM cache's): the agent's registry
// options, decryption with the keys the caller may use there, and
// encryption for ns's recipients.
func (s *Server) storeFor(ctx context.Context, ns string) ([]ociimage.Option, error) {
	c, err := requestCaller(ctx)
	if err != nil {
		return nil, err
	}
	opts := append([]ociimage.Option(nil), s.cfg.Store...)
	nsKeys, err := s.keysOf(ns)
	if err != nil {
		return nil, err
	}
	keys := nsKeys
	if c.Admin && s.keys != nil {
		node, err := s.keys.set("")
		if err != nil {
			return nil, s.keyTrouble("the node's", err)
		}
		keys = append(keys, node...)
	}
	if len(keys) > 0 {
		opts = append(opts, imgcrypt.WithDecryptionKeys(keys...))
	}
	if enc, ok := s.encryptionFor(nsKeys); ok {
		opts = append(opts, imgcrypt.WithEncryption(enc))
	}
	return opts, nil
}

// keysOf reads namespace ns's keys (none for "" or without a key directory).
func (s *Server) keysOf(ns string) ([]imgcrypt.DecryptionKey, error) {
	if s.keys == nil || ns == "" {
		return nil, nil
	}
	if !isDNSLabel(ns) {
		// No directory can be named so (openKeyDir): no keys.
		return nil, nil
	}
	keys, err := s.keys.set(ns)
	if err != nil {
		return nil, s.keyTrouble("namespace "+ns+"'s", err)
	}
	return keys, nil
}

// keyTrouble is a key set that read at start and fails now (a rotated
// Secret with a bad key): the operator's to fix, not the caller's.
func (s *Server) keyTrouble(whose string, err error) error {
	s.log.Error("reading decryption keys", "set", whose, "err", err)
	return errcode.Wrap(errcode.Internal, err, "the agent cannot read %s decryption keys: ask the node's administrator to fix its --decryption-key-dir", whose)
}

// encryptionFor is what a checkpoint of a VM whose namespace has nsKeys is
// encrypted for; false: nothing, it is stored in the clear.
func (s *Server) encryptionFor(nsKeys []imgcrypt.DecryptionKey) (imgcrypt.EncryptOptions, bool) {
	var enc imgcrypt.EncryptOptions
	if s.cfg.Encrypt != nil {
		enc = *s.cfg.Encrypt
		enc.Recipients = append([]imgcrypt.Recipient(nil), enc.Recipients...)
	}
	for _, k := range nsKeys {
		enc.Recipients = append(enc.Recipients, k.Recipient())
	}
	return enc, len(enc.Recipients) > 0
}
