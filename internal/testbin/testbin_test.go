package testbin

import (
	"os/exec"
	"strings"
	"testing"
)

// TestCosign builds (or finds cached) the cosign CLI and checks that it
// reports the pinned version. make test starts it early, in the
// background, so that the build overlaps other tests.
func TestCosign(t *testing.T) {
	bin := Cosign.Require(t)
	out, err := exec.Command(bin, "version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), Cosign.Version) {
		t.Fatalf("cosign version: %v: %s (want %s)", err, out, Cosign.Version)
	}
}
