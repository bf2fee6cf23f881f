package tools

import (
	"os/exec"
	"strings"
	"testing"
)

// Each tool builds (or is found in the cache) and is the pinned version.
// make tools runs the crane and oras subtests before the tests; make test
// runs the cosign one in the background beside them (it takes minutes).
func TestToolsArePinned(t *testing.T) {
	for _, c := range []struct {
		tool Tool
		args []string
		want string
	}{
		{Crane, []string{"version"}, "v0.22.1"},
		{ORAS, []string{"version"}, "Version:    1.3.6"},
		{Cosign, []string{"version"}, "v2.6.5"},
	} {
		t.Run(c.tool.Name, func(t *testing.T) {
			out, err := exec.Command(c.tool.Path(t), c.args...).CombinedOutput()
			if err != nil || !strings.Contains(string(out), c.want) {
				t.Errorf("%s %v: %v\n%s; want %q", c.tool.Name, c.args, err, out, c.want)
			}
		})
	}
}
