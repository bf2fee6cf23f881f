package agent

// The agent's private keys, one set per namespace (--decryption-key-dir).
//
//	DIR/KEY       the node's keys: regular files directly in DIR
//	DIR/NS/KEY    namespace NS's keys
//
// Who may use which set is keys.go's business; this file reads them. The
// directory is the operator's (a mounted Secret), and it is still read as
// if it were not: beneath a handle of DIR (a link is followed only while it
// stays below DIR: a Secret volume's files are links into its ..data),
// regular files only, each with the mode a key file must have, at most
// maxKeyFileBytes each and maxKeysPerSet per set. Dot files (a Secret
// volume's ..data) are skipped.

import (
	"errors"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
	"syscall"

	"github.com/vmsnap/vmsnap/internal/beneath"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
)

const (
	// maxKeyFileBytes bounds a key file: an RSA 8192 key's PEM is 6.4 KB.
	maxKeyFileBytes = 64 << 10
	// maxKeysPerSet bounds the files of one set (and the namespaces).
	maxKeysPerSet = 64
)

// keyDir is an open --decryption-key-dir.
type keyDir struct {
	root *os.File // O_PATH handle of DIR
	path string
}

// openKeyDir opens dir and reads every key in it once, so that a bad key
// or a misplaced file stops the agent at start (USAGE) rather than failing
// a tenant's restore later. "" is no directory: no keys at all.
func openKeyDir(dir string) (*keyDir, error) {
	if dir == "" {
		return nil, nil
	}
	root, err := beneath.Dir(dir)
	if err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "--decryption-key-dir %s", dir)
	}
	kd := &keyDir{root: root, path: dir}
	namespaces, err := kd.namespaces()
	if err == nil {
		_, err = kd.set("")
	}
	for _, ns := range namespaces {
		if err == nil {
			_, err = kd.set(ns)
		}
	}
	if err != nil {
		root.Close()
		return nil, err
	}
	return kd, nil
}

// CheckDecryptionKeyDir reads every key in dir as the agent will (USAGE if
// one is bad): for a command line to check before it starts anything else.
func CheckDecryptionKeyDir(dir string) error {
	kd, err := openKeyDir(dir)
	if kd != nil {
		kd.root.Close()
	}
	return err
}

// namespaces lists the namespaces that have a directory in DIR.
func (kd *keyDir) namespaces() ([]string, error) {
	var out []string
	names, err := kd.list(".")
	for _, name := range names {
		if t, err := kd.typeOf(name); err != nil || t != fs.ModeDir {
			continue
		}
		if !isDNSLabel(name) {
			return nil, errcode.New(errcode.Usage, "--decryption-key-dir %s: %s is a directory but not a namespace name (a DNS label); each directory holds one namespace's keys", kd.path, name)
		}
		out = append(out, name)
	}
	return out, err
}

// set reads one set of keys: the node's for ns "", namespace ns's
// otherwise (none if DIR/ns does not exist).
func (kd *keyDir) set(ns string) ([]imgcrypt.DecryptionKey, error) {
	dir := "."
	if ns != "" {
		dir = ns
		if t, err := kd.typeOf(ns); errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		} else if err != nil || t != fs.ModeDir {
			return nil, kd.refuse(ns, err, t, "a directory of namespace "+ns+"'s keys")
		}
	}
	names, err := kd.list(dir)
	if err != nil {
		return nil, err
	}
	var keys []imgcrypt.DecryptionKey
	for _, name := range names {
		rel := path.Join(dir, name)
		k, isDir, err := kd.key(rel)
		if err != nil {
			return nil, err
		}
		if !isDir {
			keys = append(keys, k)
		}
	}
	return keys, nil
}

// list returns the names in the directory rel, dot files left out.
func (kd *keyDir) list(rel string) ([]string, error) {
	f, err := kd.open(rel)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	entries, err := f.ReadDir(maxKeysPerSet*2 + 8) // a Secret volume's dot entries besides
	if err != nil && err != io.EOF {
		return nil, errcode.Wrap(errcode.Usage, err, "--decryption-key-dir %s: listing %s", kd.path, rel)
	}
	var names []string
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), ".") {
			names = append(names, e.Name())
		}
	}
	if len(names) > maxKeysPerSet {
		return nil, errcode.New(errcode.Usage, "--decryption-key-dir %s: %s has more than %d entries", kd.path, rel, maxKeysPerSet)
	}
	return names, nil
}

// key reads the key file rel. A directory is reported, not read: at the
// top, it is a namespace's; below, it is refused.
func (kd *keyDir) key(rel string) (k imgcrypt.DecryptionKey, isDir bool, err error) {
	name := path.Join(kd.path, rel)
	f, err := kd.open(rel)
	if err != nil {
		return k, false, err
	}
	defer f.Close()
	fi, err := f.Stat()
	switch {
	case err != nil:
		return k, false, errcode.Wrap(errcode.Usage, err, "decryption key %s", name)
	case fi.IsDir() && !strings.Contains(rel, "/"):
		return k, true, nil
	case !fi.Mode().IsRegular():
		return k, false, kd.refuse(rel, nil, fi.Mode().Type(), "a regular file (a PEM private key)")
	}
	if err := imgcrypt.CheckKeyMode(name, fi.Mode().Perm()); err != nil {
		return k, false, err
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); !ok || st.Uid != 0 && int(st.Uid) != os.Geteuid() {
		return k, false, errcode.New(errcode.Usage, "decryption key %s is not owned by root or the agent's user: only they may give the agent keys", name)
	}
	data, err := io.ReadAll(io.LimitReader(f, maxKeyFileBytes+1))
	defer clear(data)
	if err != nil {
		return k, false, errcode.Wrap(errcode.Usage, err, "decryption key %s", name)
	}
	if len(data) > maxKeyFileBytes {
		return k, false, errcode.New(errcode.Usage, "decryption key %s is over %d bytes: not a PEM private key", name, maxKeyFileBytes)
	}
	k, err = imgcrypt.ParseDecryptionKey(data, name)
	return k, false, err
}

// open opens rel below DIR for reading, a directory or a regular file:
// its type is checked on the O_PATH descriptor before it is opened for
// reading, so that a FIFO or a device is never opened.
func (kd *keyDir) open(rel string) (*os.File, error) {
	p, err := beneath.OpenFollowing(kd.root, rel, path.Join(kd.path, rel))
	if err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "--decryption-key-dir %s", kd.path)
	}
	defer p.Close()
	if t, err := beneath.Type(p); err != nil || t != fs.ModeDir && t != 0 {
		return nil, kd.refuse(rel, err, t, "a directory or a regular file")
	}
	f, err := beneath.Reopen(p)
	if err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "--decryption-key-dir %s", kd.path)
	}
	return f, nil
}

// typeOf is the type of rel below DIR (links within DIR followed).
func (kd *keyDir) typeOf(rel string) (fs.FileMode, error) {
	p, err := beneath.OpenFollowing(kd.root, rel, path.Join(kd.path, rel))
	if err != nil {
		return 0, err
	}
	defer p.Close()
	return beneath.Type(p)
}

func (kd *keyDir) refuse(rel string, err error, t fs.FileMode, want string) error {
	if err != nil {
		return errcode.Wrap(errcode.Usage, err, "--decryption-key-dir %s: %s", kd.path, rel)
	}
	return errcode.New(errcode.Usage, "--decryption-key-dir %s: %s is %s, not %s", kd.path, rel, beneath.TypeName(t), want)
}
