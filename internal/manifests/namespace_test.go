package manifests

import (
	"slices"
	"strings"
	"testing"
)

// A per-tenant --allow-repository entry ({namespace}) passes validation and
// reaches the agent's command line unchanged, with a comment saying what
// the placeholder means.
func TestAllowRepositoryNamespacePlaceholderPassesThrough(t *testing.T) {
	const entry = "10.0.0.5:5000/vms/{namespace}"
	o := Options{AllowRepositories: []string{entry}, LayoutRoot: "/srv/layouts"}
	r := render(t, o)
	cmd := r.ds.Spec.Template.Spec.Containers[0].Command
	i := slices.Index(cmd, "--allow-repository")
	if i < 0 || i+1 >= len(cmd) || cmd[i+1] != entry {
		t.Fatalf("command %q lacks --allow-repository %s", cmd, entry)
	}
	if c := commentAbove(t, r.doc(t, "DaemonSet"), "- "+entry); !strings.Contains(c, "{namespace}") || !strings.Contains(c, "caller's namespace") {
		t.Errorf("the entry's comment does not explain {namespace}: %q", c)
	}
}
