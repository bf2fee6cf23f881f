package snapshot

import (
	"os/exec"
	"strings"
	"testing"
)

// TestSnapshotDoesNotImportTheDaemon: the operations are a library of their
// own; a program that runs them (the CLI's local commands, other Go code)
// does not link package agent, the daemon and its client.
func TestSnapshotDoesNotImportTheDaemon(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go tool to list the package's imports:", err)
	}
	out, err := exec.Command(goTool, "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	deps := strings.Fields(string(out))
	if len(deps) < 10 || !strings.HasSuffix(deps[len(deps)-1], "/internal/snapshot") {
		t.Fatalf("go list -deps listed %d packages, ending %q: not this package's", len(deps), deps[len(deps)-1])
	}
	for _, d := range deps {
		if d == "github.com/vmsnap/vmsnap/agent" {
			t.Fatalf("package snapshot imports %s, the daemon: %v", d, deps)
		}
	}
}
