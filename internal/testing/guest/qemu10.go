package guest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

// QEMU 10 for the tests of what newer QEMU offers (mapped-ram, multifd):
// Debian bookworm-backports' QEMU 10.0, never installed, only unpacked from
// its .debs (dpkg-deb -x) into the test cache, and run from there beside the
// system's QEMU 7.2. It needs no library beyond what QEMU 7.2 already
// pulled in on Debian 12.
//
// Environment:
//
//	VMSNAP_TEST_QEMU10     an unpacked tree to use instead (its usr/bin/qemu-system-x86_64 etc.)
//	VMSNAP_DEBIAN_MIRROR   where the .debs come from (default http://deb.debian.org/debian/)
const (
	EnvQEMU10       = "VMSNAP_TEST_QEMU10"
	EnvDebianMirror = "VMSNAP_DEBIAN_MIRROR"
	defaultMirror   = "http://deb.debian.org/debian/"
)

// qemu10Debs are the packages, by pool path and pinned SHA256 (checked
// before a byte of them is unpacked).
var qemu10Debs = []struct{ pool, sha256 string }{
	{"pool/main/q/qemu/qemu-system-x86_10.0.2+ds-2+deb13u1~bpo12+1_amd64.deb", "4a6b1856c8b0d7df4ff8e70249e12c473ccf8d516aadb4ae14d3d938faed0c65"},
	{"pool/main/q/qemu/qemu-system-common_10.0.2+ds-2+deb13u1~bpo12+1_amd64.deb", "23a4672a138832d7173855e981aa8282c73ef5e04e080fa7ada9f82c6b34f507"},
	{"pool/main/q/qemu/qemu-system-data_10.0.2+ds-2+deb13u1~bpo12+1_all.deb", "2d831088187087013b3fcbd19bdfb955b182a2d5a08f6dafa0ad1c6d2007fb4e"},
	{"pool/main/s/seabios/seabios_1.16.3-2~bpo12+1_all.deb", "48390d0a534c66d11789e39518aa219773a9d3677b29fe1af8799dfb563ec713"},
}

// QEMU10Version is the version the pinned packages hold.
const QEMU10Version = "10.0.2"

var qemu10 struct {
	once sync.Once
	root string
	skip string
	err  error
}

// QEMU10 returns the root of an unpacked QEMU 10 tree, for Options.QEMURoot:
// $VMSNAP_TEST_QEMU10, else the pinned Debian packages, downloaded (once,
// into the test cache, verified against their SHA256) and unpacked on first
// use. It skips t, loudly and with the reason, when that cannot be done (no
// network, no dpkg-deb, a package gone from the mirror), and fails it
// instead under VMSNAP_TEST_REQUIRE_QEMU=1.
func QEMU10(t testing.TB) string {
	t.Helper()
	qemu10.once.Do(setupQEMU10)
	if qemu10.skip != "" {
		skipf(t, "QEMU 10: %s", qemu10.skip)
	}
	if qemu10.err != nil {
		t.Fatalf("setting up QEMU 10: %v", qemu10.err)
	}
	return qemu10.root
}

func setupQEMU10() {
	if root := os.Getenv(EnvQEMU10); root != "" {
		qemu10.root, qemu10.skip = root, checkQEMURoot(root)
		return
	}
	if _, err := exec.LookPath("dpkg-deb"); err != nil {
		qemu10.skip = "dpkg-deb not found (needs a Debian-based host), and " + EnvQEMU10 + " is not set"
		return
	}
	cache, err := CacheDir()
	if err != nil {
		qemu10.skip = err.Error()
		return
	}
	dir := filepath.Join(cache, "qemu10")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		qemu10.skip = fmt.Sprintf("cannot create %s: %v", dir, err)
		return
	}
	unlock, err := LockFile(filepath.Join(dir, ".lock"))
	if err != nil {
		qemu10.err = fmt.Errorf("locking %s: %w", dir, err)
		return
	}
	defer unlock()
	root := filepath.Join(dir, "root")
	qemu10.root = root
	stamp := qemu10Stamp()
	if b, err := os.ReadFile(filepath.Join(root, ".vmsnap-stamp")); err == nil && string(b) == stamp {
		qemu10.skip = checkQEMURoot(root)
		return
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var debs []string
	for _, d := range qemu10Debs {
		path, skip, err := fetchDeb(ctx, dir, d.pool, d.sha256)
		if skip != "" || err != nil {
			qemu10.skip, qemu10.err = skip, err
			return
		}
		debs = append(debs, path)
	}
	tmp, err := os.MkdirTemp(dir, ".root.")
	if err != nil {
		qemu10.err = err
		return
	}
	defer os.RemoveAll(tmp)
	for _, deb := range debs {
		if out, err := exec.CommandContext(ctx, "dpkg-deb", "-x", deb, tmp).CombinedOutput(); err != nil {
			qemu10.err = fmt.Errorf("dpkg-deb -x %s: %v\n%s", deb, err, out)
			return
		}
	}
	if err := os.WriteFile(filepath.Join(tmp, ".vmsnap-stamp"), []byte(stamp), 0o644); err != nil {
		qemu10.err = err
		return
	}
	// Swap the new tree in; an older one (another stamp, or none) goes.
	if _, err := os.Stat(root); err == nil {
		old := filepath.Join(dir, fmt.Sprintf(".old.%d", time.Now().UnixNano()))
		if err := os.Rename(root, old); err != nil {
			qemu10.err = err
			return
		}
		defer os.RemoveAll(old)
	}
	if err := os.Rename(tmp, root); err != nil {
		qemu10.err = err
		return
	}
	qemu10.skip = checkQEMURoot(root)
}

func qemu10Stamp() string {
	h := sha256.New()
	for _, d := range qemu10Debs {
		fmt.Fprintln(h, d.pool, d.sha256)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// fetchDeb returns dir/NAME.deb, checked against sum, downloading it from
// the mirror when it is missing or does not match. A download that cannot
// be done is a skip; a download that does not match its pinned sum is an
// error.
func fetchDeb(ctx context.Context, dir, pool, sum string) (path, skip string, err error) {
	path = filepath.Join(dir, filepath.Base(pool))
	if got, err := fileSHA256(path); err == nil && got == sum {
		return path, "", nil
	}
	mirror := os.Getenv(EnvDebianMirror)
	if mirror == "" {
		mirror = defaultMirror
	}
	url := strings.TrimSuffix(mirror, "/") + "/" + pool
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Sprintf("downloading %s failed: %v (set %s to an unpacked QEMU 10 tree, or %s to a reachable mirror)", url, err, EnvQEMU10, EnvDebianMirror), nil
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Sprintf("downloading %s: %s (the package may have left the mirror: update the pins in internal/testing/guest/qemu10.go)", url, resp.Status), nil
	}
	f, err := os.CreateTemp(dir, ".dl.")
	if err != nil {
		return "", "", err
	}
	defer os.Remove(f.Name())
	h := sha256.New()
	_, err = io.Copy(io.MultiWriter(f, h), resp.Body)
	if err == nil {
		err = f.Chmod(0o644)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", fmt.Sprintf("downloading %s failed part-way: %v", url, err), nil
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != sum {
		return "", "", fmt.Errorf("%s has SHA256 %s, but %s is pinned: refusing to use it", url, got, sum)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return "", "", err
	}
	return path, "", nil
}

func fileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

var qemuVersionRE = regexp.MustCompile(`QEMU emulator version ([0-9]+\.[0-9]+\.[0-9]+)`)

// checkQEMURoot runs the tree's QEMU once; it returns why it cannot run,
// or "".
func checkQEMURoot(root string) string {
	bin, _, env := qemuFromRoot(root)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "--version")
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return fmt.Sprintf("%s not found", bin)
		}
		return fmt.Sprintf("%s --version: %v: %s (a library missing on this host?)", bin, err, strings.TrimSpace(string(out)))
	}
	if !qemuVersionRE.Match(out) {
		return fmt.Sprintf("%s --version printed no version: %s", bin, out)
	}
	return ""
}

// qemuFromRoot is how a QEMU unpacked at root runs: its binary, the -L
// flags that find its firmware (its own, then its SeaBIOS), and
// QEMU_MODULE_DIR for its modules.
func qemuFromRoot(root string) (bin string, args, env []string) {
	return filepath.Join(root, "usr/bin", QEMUBinary),
		[]string{"-L", filepath.Join(root, "usr/share/qemu"), "-L", filepath.Join(root, "usr/share/seabios")},
		[]string{"QEMU_MODULE_DIR=" + filepath.Join(root, "usr/lib/x86_64-linux-gnu/qemu")}
}

// QEMU10Command is how to run the QEMU 10 of QEMU10(t): its binary, the
// arguments that find its firmware, and the environment that finds its
// modules.
func QEMU10Command(t testing.TB) (bin string, args, env []string) {
	t.Helper()
	return qemuFromRoot(QEMU10(t))
}
