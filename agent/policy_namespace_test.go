package agent

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Per-tenant repositories: {namespace} in --allow-repository is the
// caller's namespace, one whole component; an admin matches any namespace.
func TestAllowRepositoryNamespacePlaceholder(t *testing.T) {
	pol, err := newImagePolicy([]string{"reg:5000/vms/{namespace}", "reg:5000/{namespace}/x/y", "reg:5000/shared"}, "", t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	odd := Caller{Namespace: "Tenant_A", Pod: "p", Container: "c"} // not a DNS label: matches no placeholder
	for _, tc := range []struct {
		c       Caller
		ref     string
		allowed bool
	}{
		{callerA, "reg:5000/vms/tenant-a:t", true},
		{callerA, "reg:5000/vms/tenant-a/vm:t", true},
		{callerA, "reg:5000/tenant-a/x/y/vm:t", true},
		{callerA, "reg:5000/vms/tenant-b/vm:t", false}, // another tenant's repository
		{callerB, "reg:5000/vms/tenant-a/vm:t", false},
		{callerB, "reg:5000/vms/tenant-b/vm:t", true},
		{callerA, "reg:5000/vms/tenant-ab/vm:t", false},
		{callerA, "reg:5000/vms/tenant-a-x/vm:t", false},
		{callerA, "reg:5000/vms:t", false},
		{callerA, "reg:5000/tenant-a/x/z:t", false},
		{callerA, "reg:5000/tenant-a/x:t", false},
		{callerA, "reg:5000/shared/vm:t", true}, // plain entries stay node-wide
		{callerA, "other:5000/vms/tenant-a/vm:t", false},
		{callerAdmin, "reg:5000/vms/tenant-a/vm:t", true},
		{callerAdmin, "reg:5000/vms/tenant-b:t", true},
		{callerAdmin, "reg:5000/vms/platform/vm:t", true},
		{callerAdmin, "reg:5000/vms/a_b/vm:t", false}, // not a namespace
		{callerAdmin, "reg:5000/vms:t", false},
		{odd, "reg:5000/vms/tenant_a/vm:t", false},
		{odd, "reg:5000/shared/vm:t", true},
		{Caller{Namespace: "", PID: 1}, "reg:5000/vms/x:t", false}, // no namespace, no admin: nothing to substitute
	} {
		err := pol.check(tc.c, "image", tc.ref)
		if tc.allowed && err != nil || !tc.allowed && errcode.Of(err) != errcode.Forbidden {
			t.Errorf("%s as %s: %v, want allowed=%v", tc.ref, tc.c, err, tc.allowed)
		}
	}
	if err := pol.check(callerA, "image", "reg:5000/vms/{namespace}/vm:t"); errcode.Of(err) != errcode.InvalidInput {
		t.Errorf("a reference with the placeholder itself: %v, want INVALID_INPUT", err)
	}
	err = pol.check(callerB, "image", "reg:5000/vms/tenant-a/vm:t")
	if !strings.Contains(err.Error(), "reg:5000/vms/{namespace}") || !strings.Contains(err.Error(), "pod tenant-b/") {
		t.Errorf("the refusal does not say which entries apply to whom: %v", err)
	}
}

func TestAllowRepositoryPlaceholderOnlyAsAComponent(t *testing.T) {
	for _, bad := range []string{"reg/vms-{namespace}", "reg/{namespace}x", "{namespace}/vms", "reg:{namespace}/vms",
		"reg/vms/{Namespace}", "reg/vms/{namespace", "reg/vms/{}", "reg/vms/{namespace}:t", "reg/vms/{namespace}/../x"} {
		if _, err := newImagePolicy([]string{bad}, "", t.TempDir()); errcode.Of(err) != errcode.Usage {
			t.Errorf("--allow-repository %q: %v, want USAGE", bad, err)
		}
	}
	for _, good := range []string{"reg.example/{namespace}", "reg:5000/vms/{namespace}/", "reg.example/{namespace}/{namespace}"} {
		if _, err := newImagePolicy([]string{good}, "", t.TempDir()); err != nil {
			t.Errorf("--allow-repository %q: %v", good, err)
		}
	}
}

// A caller in a pod has its namespace's directory under the layout root,
// and nothing else of it; an admin has the whole root.
func TestLayoutRootPerNamespace(t *testing.T) {
	root := t.TempDir()
	for _, d := range []string{"tenant-a/vm", "tenant-b/vm"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	pol, err := newImagePolicy(nil, root, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	odd := Caller{Namespace: "..", Pod: "p", Container: "c"}
	for _, tc := range []struct {
		c       Caller
		dir     string
		allowed bool
	}{
		{callerA, root + "/tenant-a/vm", true},
		{callerA, root + "/tenant-a/new/deeper", true},
		{callerA, root + "/tenant-a", true},
		{callerA, root + "/tenant-b/vm", false},
		{callerB, root + "/tenant-a/vm", false},
		{callerA, root + "/tenant-ab", false},
		{callerA, root, false},
		{callerA, root + "/x", false},
		{callerA, root + "/tenant-a/../tenant-b/vm", false},
		{odd, root + "/../x", false},
		{odd, root + "/x", false},
		{callerAdmin, root + "/tenant-a/vm", true},
		{callerAdmin, root + "/tenant-b/vm", true},
		{callerAdmin, root + "/anything", true},
	} {
		err := pol.check(tc.c, "image", "oci:"+tc.dir+":t")
		if tc.allowed && err != nil || !tc.allowed && errcode.Of(err) != errcode.Forbidden {
			t.Errorf("oci:%s as %s: %v, want allowed=%v", tc.dir, tc.c, err, tc.allowed)
		}
	}
}

// A directory under the layout root that someone besides the agent may
// change is refused: its owner could swap a component for a link after the
// check and before ociimage opens the layout by name. The test runs as
// root, so it stands in for a tenant with uid 1000.
func TestLayoutRootRefusesDirectoriesOthersMayChange(t *testing.T) {
	root := t.TempDir()
	tenantDir := filepath.Join(root, "tenant-a")
	if err := os.MkdirAll(filepath.Join(tenantDir, "vm"), 0o755); err != nil {
		t.Fatal(err)
	}
	pol, err := newImagePolicy(nil, root, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	ref := "oci:" + tenantDir + "/vm/inner:t"
	if err := pol.check(callerA, "image", ref); err != nil {
		t.Fatalf("the agent's own directories: %v", err)
	}
	// Writable by others.
	if err := os.Chmod(filepath.Join(tenantDir, "vm"), 0o777); err != nil {
		t.Fatal(err)
	}
	if err := pol.check(callerA, "image", ref); errcode.Of(err) != errcode.Forbidden || !strings.Contains(err.Error(), "only the agent writes") {
		t.Errorf("a world-writable directory on the way: %v, want FORBIDDEN", err)
	}
	if err := pol.check(callerAdmin, "image", ref); errcode.Of(err) != errcode.Forbidden {
		t.Errorf("a world-writable directory on the way, for an admin: %v, want FORBIDDEN", err)
	}
	if err := os.Chmod(filepath.Join(tenantDir, "vm"), 0o755); err != nil {
		t.Fatal(err)
	}
	// Another user's (a tenant's volume mounted there, say).
	if os.Geteuid() != 0 {
		t.Skip("changing a directory's owner needs root")
	}
	if err := os.Chown(tenantDir, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	if err := pol.check(callerA, "image", ref); errcode.Of(err) != errcode.Forbidden {
		t.Errorf("a directory of another user on the way: %v, want FORBIDDEN", err)
	}
	if err := os.Chown(tenantDir, 0, 0); err != nil {
		t.Fatal(err)
	}
	// The root itself, at startup and on every check.
	if err := os.Chmod(root, 0o777); err != nil {
		t.Fatal(err)
	}
	if _, err := newImagePolicy(nil, root, t.TempDir()); errcode.Of(err) != errcode.Usage {
		t.Errorf("a world-writable --layout-root: %v, want USAGE", err)
	}
	if err := pol.check(callerAdmin, "image", ref); errcode.Of(err) != errcode.Forbidden {
		t.Errorf("a layout root made world-writable after startup: %v, want FORBIDDEN", err)
	}
}

// A layout root below a directory others may change is refused at startup:
// they could swap the root itself for a link.
func TestLayoutRootRefusesUnsafeParents(t *testing.T) {
	parent := filepath.Join(t.TempDir(), "shared")
	root := filepath.Join(parent, "layouts")
	if err := os.MkdirAll(root, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := newImagePolicy(nil, root, t.TempDir()); err != nil {
		t.Fatalf("a root whose parents only root or the agent writes: %v", err)
	}
	if err := os.Chmod(parent, 0o777); err != nil {
		t.Fatal(err)
	}
	if _, err := newImagePolicy(nil, root, t.TempDir()); errcode.Of(err) != errcode.Usage || !strings.Contains(err.Error(), parent) {
		t.Errorf("a root below a world-writable directory: %v, want USAGE naming it", err)
	}
	if err := os.Chmod(parent, 0o777|os.ModeSticky); err != nil {
		t.Fatal(err)
	}
	if _, err := newImagePolicy(nil, root, t.TempDir()); err != nil {
		t.Errorf("a root below a sticky directory (as /tmp): %v", err)
	}
}
