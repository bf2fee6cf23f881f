package cluster

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

// Version is the Kubernetes release the test cluster runs: the version
// testdata/k8s/go.mod requires, stamped into the binaries (the apiserver
// derives its emulation version from it, and refuses v0.0.0).
const Version = "v1.37.2"

// moduleDir is the Go module, relative to the repository root, that builds
// the Kubernetes binaries and the pause program.
const moduleDir = "testdata/k8s"

// Commands the harness builds, by binary name.
var commands = map[string]string{
	"kube-apiserver":          "k8s.io/kubernetes/cmd/kube-apiserver",
	"kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
	"kube-scheduler":          "k8s.io/kubernetes/cmd/kube-scheduler",
	"kubelet":                 "k8s.io/kubernetes/cmd/kubelet",
	"kubectl":                 "k8s.io/kubernetes/cmd/kubectl",
}

// buildTimeout bounds one build of every binary: about 6 minutes from a
// cold Go build cache on 2 cores.
const buildTimeout = 25 * time.Minute

// Binaries returns the directory holding the Kubernetes binaries and pause,
// building them first if the cache lacks them:
// $VMSNAP_TEST_CACHE/k8s/VERSION-GOSUMHASH/. A file lock serialises builds
// across test binaries; a build goes to a temporary directory renamed into
// place, so a crashed build leaves nothing half-made.
func Binaries() (string, error) {
	root, err := guest.RepoRoot()
	if err != nil {
		return "", err
	}
	mod := filepath.Join(root, moduleDir)
	sum, err := os.ReadFile(filepath.Join(mod, "go.sum"))
	if err != nil {
		return "", err
	}
	h := sha256.Sum256(sum)
	cache, err := guest.CacheDir()
	if err != nil {
		return "", err
	}
	base := filepath.Join(cache, "k8s")
	dir := filepath.Join(base, Version+"-"+hex.EncodeToString(h[:6]))
	if haveBinaries(dir) {
		return dir, nil
	}
	if err := os.MkdirAll(base, 0o755); err != nil {
		return "", err
	}
	unlock, err := guest.LockFile(filepath.Join(base, "build.lock"))
	if err != nil {
		return "", err
	}
	defer unlock()
	if haveBinaries(dir) { // built by another test binary while we waited
		return dir, nil
	}
	tmp, err := os.MkdirTemp(base, ".build-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	if err := goBuild(mod, tmp); err != nil {
		return "", err
	}
	os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		return "", err
	}
	return dir, nil
}

func haveBinaries(dir string) bool {
	for _, name := range append(keys(commands), "pause") {
		if fi, err := os.Stat(filepath.Join(dir, name)); err != nil || !fi.Mode().IsRegular() {
			return false
		}
	}
	return true
}

func goBuild(mod, out string) error {
	start := time.Now()
	var pkgs []string
	for _, p := range commands {
		pkgs = append(pkgs, p)
	}
	major, minor, _ := strings.Cut(strings.TrimPrefix(Version, "v"), ".")
	minor, _, _ = strings.Cut(minor, ".")
	var ldflags []string
	for _, pkg := range []string{"k8s.io/component-base/version", "k8s.io/client-go/pkg/version"} {
		ldflags = append(ldflags,
			"-X "+pkg+".gitVersion="+Version,
			"-X "+pkg+".gitMajor="+major,
			"-X "+pkg+".gitMinor="+minor,
			"-X "+pkg+".gitTreeState=clean",
			"-X "+pkg+".buildDate=1970-01-01T00:00:00Z")
	}
	fmt.Fprintf(os.Stderr, "cluster: building Kubernetes %s binaries (about 6 minutes on 2 cores from a cold cache)\n", Version)
	err := run(mod, out, "go", append([]string{"build", "-o", out + "/", "-ldflags", strings.Join(ldflags, " ")}, pkgs...)...)
	if err == nil {
		// The pause program runs alone in an image: static, without cgo.
		err = run(mod, out, "env", "CGO_ENABLED=0", "go", "build", "-o", filepath.Join(out, "pause"), "./pause")
	}
	if err != nil {
		return fmt.Errorf("building the Kubernetes binaries in %s: %v", mod, err)
	}
	fmt.Fprintf(os.Stderr, "cluster: built in %v\n", time.Since(start).Round(time.Second))
	return nil
}

func keys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// run runs name args in dir, bounded by buildTimeout, and returns the tail
// of its output with its error.
func run(dir, logDir, name string, args ...string) error {
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	log, err := os.Create(filepath.Join(logDir, "build.log"))
	if err != nil {
		return err
	}
	defer log.Close()
	cmd.Stdout, cmd.Stderr = log, log
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		return err
	}
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-time.After(buildTimeout):
		cmd.Process.Kill()
		err = fmt.Errorf("timed out after %v", buildTimeout)
		<-done
	}
	if err != nil {
		b, _ := os.ReadFile(filepath.Join(logDir, "build.log"))
		return fmt.Errorf("%s %s: %v\n%s", name, strings.Join(args, " "), err, tail(b, 4000))
	}
	return os.Remove(filepath.Join(logDir, "build.log"))
}

func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}
