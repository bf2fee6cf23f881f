package testtools

import (
	"os/exec"
	"strings"
	"testing"
)

// Each tool builds (or is found in the cache) and is the pinned version.
func TestToolsArePinned(t *testing.T) {
	for _, c := range []struct {
		tool Tool
		args []string
		want string
	}{
		{Crane, []string{"version"}, "v0.22.1"},
		{ORAS, []string{"version"}, "Version:    1.3.6"},
	} {
		out, err := exec.Command(c.tool.Path(t), c.args...).CombinedOutput()
		if err != nil || !strings.Contains(string(out), c.want) {
			t.Errorf("%s %v: %v\n%s; want %q", c.tool.Name, c.args, err, out, c.want)
		}
	}
}
