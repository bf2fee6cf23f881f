// Package tools builds the independent clients that vmsnap's
// interoperability tests drive (crane, oras, the cosign CLI) from the Go
// module proxy, at pinned versions, into the test cache, as
// internal/testing/cluster builds the Kubernetes binaries. A build goes to a
// temporary directory renamed into place under a file lock, so concurrent
// test binaries build a tool once and a crashed build leaves nothing
// half-made.
//
// When the Go toolchain is missing, or the build fails, the test skips with
// the reason, or fails under VMSNAP_TEST_REQUIRE_QEMU=1 (CI). None of this
// is for vmsnap itself (tests build that with go build).
package tools

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

// Tool is a command built from a Go module at a pinned version.
type Tool struct {
	Name    string // the binary's name
	Package string // its main package
	Version string // the module version
	// Module, if set, is a directory of the repository whose go.mod pins
	// the tool's dependencies (for a tool whose own go.mod cannot be built
	// with go install, such as cosign's replace directives); the build is
	// cached by its go.sum too. Otherwise go install PACKAGE@VERSION.
	Module  string
	LDFlags string
	Timeout time.Duration // bound of one build on 2 cores from a cold cache
}

// The tools the interop tests use.
var (
	Crane  = Tool{Name: "crane", Package: "github.com/google/go-containerregistry/cmd/crane", Version: "v0.22.1", Timeout: 10 * time.Minute}
	ORAS   = Tool{Name: "oras", Package: "oras.land/oras/cmd/oras", Version: "v1.3.6", Timeout: 10 * time.Minute}
	Cosign = Tool{
		Name: "cosign", Package: "github.com/sigstore/cosign/v2/cmd/cosign", Version: "v2.6.5", Module: "testdata/cosign",
		LDFlags: "-s -w -X sigs.k8s.io/release-utils/version.gitVersion=v2.6.5", Timeout: 40 * time.Minute,
	}
)

// Path returns the tool's binary for t, building it first if the cache
// lacks it.
func (tl Tool) Path(t testing.TB) string {
	t.Helper()
	p, err := tl.build()
	if err != nil {
		guest.SkipOrFail(t, tl.Name, fmt.Sprintf("cannot build %s %s from the module proxy: %v", tl.Name, tl.Version, err))
	}
	return p
}

func (tl Tool) build() (string, error) {
	dir, err := tl.dir()
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, tl.Name)
	if isFile(bin) {
		return bin, nil
	}
	base := filepath.Dir(dir)
	if err := os.MkdirAll(base, 0o755); err != nil {
		return "", err
	}
	unlock, err := guest.LockFile(filepath.Join(base, tl.Name+".lock"))
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
	start := time.Now()
	fmt.Fprintf(os.Stderr, "tools: building %s %s\n", tl.Name, tl.Version)
	if err := tl.run(tmp); err != nil {
		return "", err
	}
	fmt.Fprintf(os.Stderr, "tools: built %s in %v\n", tl.Name, time.Since(start).Round(time.Second))
	os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		return "", err
	}
	return bin, nil
}

// dir is where the tool's binary is cached: $VMSNAP_TEST_CACHE/tools/
// NAME-VERSION, and the hash of its module's go.sum when it has one.
func (tl Tool) dir() (string, error) {
	cache, err := guest.CacheDir()
	if err != nil {
		return "", err
	}
	name := tl.Name + "-" + tl.Version
	if tl.Module != "" {
		root, err := guest.RepoRoot()
		if err != nil {
			return "", err
		}
		sum, err := os.ReadFile(filepath.Join(root, tl.Module, "go.sum"))
		if err != nil {
			return "", err
		}
		h := sha256.Sum256(sum)
		name += "-" + hex.EncodeToString(h[:6])
	}
	return filepath.Join(cache, "tools", name), nil
}

// run builds the tool into dir: go build in its module, or go install
// outside any module, so that it builds with its own pinned dependencies.
func (tl Tool) run(dir string) error {
	if _, err := exec.LookPath("go"); err != nil {
		return err
	}
	args := []string{"install", "-trimpath", "-ldflags", tl.LDFlags, tl.Package + "@" + tl.Version}
	cmd := exec.Command("go")
	cmd.Dir = dir
	if tl.Module != "" {
		root, err := guest.RepoRoot()
		if err != nil {
			return err
		}
		args = []string{"build", "-trimpath", "-ldflags", tl.LDFlags, "-o", filepath.Join(dir, tl.Name), tl.Package}
		cmd.Dir = filepath.Join(root, tl.Module)
	}
	cmd.Args = append(cmd.Args, args...)
	cmd.Env = append(os.Environ(), "GOBIN="+dir, "CGO_ENABLED=0")
	var out tail
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, out.String())
		}
		return nil
	case <-time.After(tl.Timeout):
		_ = cmd.Process.Kill()
		<-done
		return fmt.Errorf("go %s: timed out after %v", strings.Join(args, " "), tl.Timeout)
	}
}

// tail keeps the last 4000 bytes written to it: a build's log, bounded.
type tail struct{ b []byte }

func (t *tail) Write(p []byte) (int, error) {
	t.b = append(t.b, p...)
	if len(t.b) > 4000 {
		t.b = t.b[len(t.b)-4000:]
	}
	return len(p), nil
}

func (t *tail) String() string { return string(t.b) }

func isFile(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}
