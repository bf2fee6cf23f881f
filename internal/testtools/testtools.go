// Package testtools builds the independent OCI clients that vmsnap's
// interoperability tests drive (crane, oras) from the Go module proxy, at
// pinned versions, into the test cache: $VMSNAP_TEST_CACHE/tools/NAME-VERSION/NAME.
// A build goes to a temporary directory renamed into place under a file
// lock, so concurrent test binaries build a tool once and a crashed build
// leaves nothing half-made.
//
// When the Go toolchain is missing, or the build fails, the test skips with
// the reason, or fails under VMSNAP_TEST_REQUIRE_QEMU=1 (CI).
package testtools

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/internal/testguest"
)

// Tool is a command built from a Go module at a pinned version.
type Tool struct {
	Name    string // the binary's name
	Package string // its main package
	Version string // the module version, as go install takes it
}

// The tools the interop tests use.
var (
	Crane = Tool{Name: "crane", Package: "github.com/google/go-containerregistry/cmd/crane", Version: "v0.22.1"}
	ORAS  = Tool{Name: "oras", Package: "oras.land/oras/cmd/oras", Version: "v1.3.6"}
)

// buildTimeout bounds one build: about half a minute each on 2 cores with
// a warm module cache.
const buildTimeout = 10 * time.Minute

// Path returns the tool's binary, building it first if the cache lacks it.
func (tl Tool) Path(t testing.TB) string {
	t.Helper()
	p, err := tl.build()
	if err != nil {
		testguest.SkipOrFail(t, tl.Name, fmt.Sprintf("cannot build %s %s from the module proxy: %v", tl.Name, tl.Version, err))
	}
	return p
}

func (tl Tool) build() (string, error) {
	cache, err := testguest.CacheDir()
	if err != nil {
		return "", err
	}
	base := filepath.Join(cache, "tools")
	dir := filepath.Join(base, tl.Name+"-"+tl.Version)
	bin := filepath.Join(dir, tl.Name)
	if isFile(bin) {
		return bin, nil
	}
	if err := os.MkdirAll(base, 0o755); err != nil {
		return "", err
	}
	unlock, err := testguest.LockFile(filepath.Join(base, tl.Name+".lock"))
	if err != nil {
		return "", err
	}
	defer unlock()
	if isFile(bin) { // built by another test binary while we waited
		return bin, nil
	}
	tmp, err := os.MkdirTemp(base, ".build-"+tl.Name+"-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	if err := tl.install(tmp); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, dir); err != nil {
		return "", err
	}
	return bin, nil
}

// install runs go install PACKAGE@VERSION into dir, outside any module, so
// that the tool builds with its own module's pinned dependencies.
func (tl Tool) install(dir string) error {
	if _, err := exec.LookPath("go"); err != nil {
		return err
	}
	cmd := exec.Command("go", "install", tl.Package+"@"+tl.Version)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOBIN="+dir, "CGO_ENABLED=0")
	done := make(chan error, 1)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return err
	}
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("go install %s@%s: %v\n%s", tl.Package, tl.Version, err, out.String())
		}
		return nil
	case <-time.After(buildTimeout):
		_ = cmd.Process.Kill()
		<-done
		return fmt.Errorf("go install %s@%s: timed out after %v", tl.Package, tl.Version, buildTimeout)
	}
}

func isFile(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}
