// Package testbin builds the Go command-line tools that tests run as
// independent clients (the cosign CLI), from a module pinned under
// testdata/, into the test cache: once per version and go.sum, like the
// Kubernetes binaries of internal/testcluster.
//
// It is not for vmsnap itself (tests build that with go build) nor for
// anything a user installs.
package testbin

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

	"github.com/vmsnap/vmsnap/internal/testguest"
)

// Tool is one command built from a module under testdata/.
type Tool struct {
	Name    string // the binary's name
	Module  string // the module's directory, relative to the repository root
	Package string // the command's import path
	Version string // the release the module requires, for the cache and messages
	LDFlags string // -ldflags of the build
	// Minutes is about how long a build takes on 2 cores from a cold Go
	// cache, for the message printed while it runs.
	Minutes int
}

// Cosign is the sigstore cosign CLI at the version testdata/cosign/go.mod
// requires.
var Cosign = Tool{
	Name: "cosign", Module: "testdata/cosign", Package: "github.com/sigstore/cosign/v2/cmd/cosign", Version: "v2.6.5",
	LDFlags: "-s -w -X sigs.k8s.io/release-utils/version.gitVersion=v2.6.5", Minutes: 7,
}

// buildTimeout bounds one build.
const buildTimeout = 40 * time.Minute

// Path returns the tool's binary, building it first if the cache lacks it:
// $VMSNAP_TEST_CACHE/tools/NAME-VERSION-GOSUMHASH/NAME. A file lock
// serialises builds across test binaries (a second caller waits for the
// first's build); a build goes to a temporary directory renamed into
// place, so a crashed build leaves nothing half-made.
func (tl Tool) Path() (string, error) {
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
	if err := tl.build(tmp); err != nil {
		return "", err
	}
	os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		return "", err
	}
	return bin, nil
}

// Require returns the tool's binary for t, building it if need be. A
// build that fails is the test's failure, never a skip: the Go module
// proxy is part of the test environment.
func (tl Tool) Require(t testing.TB) string {
	t.Helper()
	bin, err := tl.Path()
	if err != nil {
		t.Fatalf("building %s %s: %v", tl.Name, tl.Version, err)
	}
	return bin
}

// dir is where the tool's binary is cached, named by its version and the
// hash of its module's go.sum.
func (tl Tool) dir() (string, error) {
	root, err := testguest.RepoRoot()
	if err != nil {
		return "", err
	}
	sum, err := os.ReadFile(filepath.Join(root, tl.Module, "go.sum"))
	if err != nil {
		return "", err
	}
	h := sha256.Sum256(sum)
	cache, err := testguest.CacheDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(cache, "tools", tl.Name+"-"+tl.Version+"-"+hex.EncodeToString(h[:6])), nil
}

func (tl Tool) build(out string) error {
	root, err := testguest.RepoRoot()
	if err != nil {
		return err
	}
	start := time.Now()
	fmt.Fprintf(os.Stderr, "testbin: building %s %s (about %d minutes on 2 cores from a cold cache)\n", tl.Name, tl.Version, tl.Minutes)
	args := []string{"build", "-trimpath", "-o", filepath.Join(out, tl.Name), "-ldflags", tl.LDFlags, tl.Package}
	if err := run(filepath.Join(root, tl.Module), out, args); err != nil {
		return fmt.Errorf("building %s in %s: %v", tl.Name, tl.Module, err)
	}
	fmt.Fprintf(os.Stderr, "testbin: built %s in %v\n", tl.Name, time.Since(start).Round(time.Second))
	return nil
}

// run runs go args in dir, bounded by buildTimeout, logging to
// logDir/build.log, and returns the log's tail with its error.
func run(dir, logDir string, args []string) error {
	logPath := filepath.Join(logDir, "build.log")
	log, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer log.Close()
	cmd := exec.Command("go", args...)
	cmd.Dir, cmd.Stdout, cmd.Stderr = dir, log, log
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-time.After(buildTimeout):
		cmd.Process.Kill()
		err = fmt.Errorf("timed out after %v", buildTimeout)
		<-done
	}
	if err != nil {
		b, _ := os.ReadFile(logPath)
		if len(b) > 4000 {
			b = b[len(b)-4000:]
		}
		return fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, b)
	}
	return os.Remove(logPath)
}

func isFile(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}
