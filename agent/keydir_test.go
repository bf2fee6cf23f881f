//go:build linux

package agent

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage/imgcrypt"
)

func keyIDsOf(keys []imgcrypt.DecryptionKey) []string {
	var ids []string
	for _, k := range keys {
		ids = append(ids, k.ID)
	}
	return ids
}

// A Kubernetes Secret volume (a projected one with a directory per
// namespace): every entry a link into ..data. The agent follows links that
// stay inside the directory, and reads each set anew, so that a rotated
// Secret applies without a restart.
func TestKeyDirReadsASecretVolume(t *testing.T) {
	dir := t.TempDir()
	node := writeKey(t, filepath.Join(dir, "..2026_01_01", "node.pem"))
	a := writeKey(t, filepath.Join(dir, "..2026_01_01", "tenant-a", "key.pem"))
	for link, to := range map[string]string{"..data": "..2026_01_01", "node.pem": "..data/node.pem", "tenant-a": "..data/tenant-a"} {
		if err := os.Symlink(to, filepath.Join(dir, link)); err != nil {
			t.Fatal(err)
		}
	}
	kd, err := openKeyDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for ns, want := range map[string]string{"": node.ID, "tenant-a": a.ID, "tenant-b": ""} {
		keys, err := kd.set(ns)
		if got := strings.Join(keyIDsOf(keys), ","); err != nil || got != want {
			t.Errorf("set %q: %s, %v; want %s", ns, got, err, want)
		}
	}
	// The kubelet swaps ..data for a new directory: the next request reads it.
	rotated := writeKey(t, filepath.Join(dir, "..2026_02_01", "tenant-a", "key.pem"))
	writeKey(t, filepath.Join(dir, "..2026_02_01", "node.pem"))
	if err := os.Symlink("..2026_02_01", filepath.Join(dir, "..data.tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "..data.tmp"), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if keys, err := kd.set("tenant-a"); err != nil || len(keys) != 1 || keys[0].ID != rotated.ID {
		t.Fatalf("after rotation: %v, %v; want the new key", keyIDsOf(keys), err)
	}
}

// What the agent refuses to read as a key, at start (USAGE) and, for what
// changes afterwards, at a request (an error, never another file's bytes):
// a link out of the directory, a FIFO (never opened: it would block), a
// device, a file others may read, a file too large, a directory that is
// not a namespace, a set with too many files.
func TestKeyDirRefusesWhatIsNotAKey(t *testing.T) {
	outside := t.TempDir()
	writeKey(t, filepath.Join(outside, "stolen.pem"))
	for name, tc := range map[string]struct {
		setup func(dir string) error
		want  string // in the error
	}{
		"link out": {func(dir string) error {
			return os.Symlink(filepath.Join(outside, "stolen.pem"), filepath.Join(dir, "tenant-a", "key.pem"))
		}, "cross-device"},
		"relative link out": {func(dir string) error {
			rel, _ := filepath.Rel(filepath.Join(dir, "tenant-a"), filepath.Join(outside, "stolen.pem"))
			return os.Symlink(rel, filepath.Join(dir, "tenant-a", "key.pem"))
		}, "cross-device"},
		"namespace link out": {func(dir string) error {
			os.Remove(filepath.Join(dir, "tenant-a"))
			return os.Symlink(outside, filepath.Join(dir, "tenant-a"))
		}, "cross-device"},
		"fifo": {func(dir string) error { return syscall.Mkfifo(filepath.Join(dir, "tenant-a", "key.pem"), 0o600) }, "a named pipe"},
		"device": {func(dir string) error {
			return syscall.Mknod(filepath.Join(dir, "tenant-a", "zero"), syscall.S_IFCHR|0o600, 1<<8|5)
		}, "a device"},
		"mode 0644": {func(dir string) error {
			writeKey(t, filepath.Join(dir, "tenant-a", "key.pem"))
			return os.Chmod(filepath.Join(dir, "tenant-a", "key.pem"), 0o644)
		}, "chmod 600"},
		"too large": {func(dir string) error {
			return os.WriteFile(filepath.Join(dir, "tenant-a", "key.pem"), make([]byte, maxKeyFileBytes+1), 0o600)
		}, "over 65536 bytes"},
		"not a namespace": {func(dir string) error { return os.Mkdir(filepath.Join(dir, "Tenant_A"), 0o700) }, "not a namespace name"},
		"a directory in a set": {func(dir string) error {
			return os.Mkdir(filepath.Join(dir, "tenant-a", "more"), 0o700)
		}, "a directory, not a regular file"},
		"too many keys": {func(dir string) error {
			for i := range maxKeysPerSet + 1 {
				if err := os.WriteFile(filepath.Join(dir, "tenant-a", strings.Repeat("k", i+1)), nil, 0o600); err != nil {
					return err
				}
			}
			return nil
		}, "more than 64 entries"},
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			if err := os.Mkdir(filepath.Join(dir, "tenant-a"), 0o700); err != nil {
				t.Fatal(err)
			}
			// At start.
			if err := tc.setup(dir); err != nil {
				t.Fatal(err)
			}
			if _, err := openKeyDirWithin(t, dir); errcode.Of(err) != errcode.Usage || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("openKeyDir: %v, want USAGE saying %q", err, tc.want)
			}
			// At a request, after the directory changed under a running agent.
			good := t.TempDir()
			writeKey(t, filepath.Join(good, "tenant-a", "key.pem"))
			kd, err := openKeyDir(good)
			if err != nil {
				t.Fatal(err)
			}
			os.RemoveAll(filepath.Join(good, "tenant-a"))
			os.Mkdir(filepath.Join(good, "tenant-a"), 0o700)
			if err := tc.setup(good); err != nil {
				t.Fatal(err)
			}
			if name == "not a namespace" {
				return // another namespace's directory: tenant-a's set is empty and fine
			}
			if keys, err := kd.set("tenant-a"); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("a request read %d keys from it (%v), want an error saying %q", len(keys), err, tc.want)
			}
		})
	}
}

// openKeyDirWithin fails the test if opening takes long: a FIFO must never
// be opened for reading.
func openKeyDirWithin(t *testing.T, dir string) (*keyDir, error) {
	type result struct {
		kd  *keyDir
		err error
	}
	done := make(chan result, 1)
	go func() { kd, err := openKeyDir(dir); done <- result{kd, err} }()
	select {
	case r := <-done:
		return r.kd, r.err
	case <-time.After(20 * time.Second):
		t.Fatal("reading the key directory blocked")
		return nil, nil
	}
}
