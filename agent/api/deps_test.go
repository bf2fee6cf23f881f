package api

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// TestAPIIsLight: the agent's callers (a Job's thin client) link the wire
// types, not vmstate, its QMP client and its store.
func TestAPIIsLight(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go tool to list the package's imports:", err)
	}
	out, err := exec.Command(goTool, "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	var ours []string
	for _, d := range strings.Fields(string(out)) {
		if strings.HasPrefix(d, "github.com/vmsnap/vmsnap/") {
			ours = append(ours, strings.TrimPrefix(d, "github.com/vmsnap/vmsnap/"))
		}
	}
	slices.Sort(ours)
	if want := []string{"agent/api", "internal/errcode", "vmstate/vmspec"}; !slices.Equal(ours, want) {
		t.Fatalf("package api links %v of vmsnap; want %v only", ours, want)
	}
}
