package agent

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

func TestAllowRepositoryMatchesOnComponentBoundaries(t *testing.T) {
	pol, err := newImagePolicy([]string{"reg.example:5000/tenants/a", "Other.Example/vms/"}, "", t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for ref, allowed := range map[string]bool{
		"reg.example:5000/tenants/a:t":                                          true,
		"reg.example:5000/tenants/a/vm:t":                                       true,
		"reg.example:5000/tenants/a/vm/disk@sha256:" + strings.Repeat("ab", 32): true,
		"REG.example:5000/tenants/a/vm:t":                                       true,  // host names are case-insensitive
		"reg.example:5000/tenants/ab:t":                                         false, // not on a component boundary
		"reg.example:5000/tenants/a-b/vm:t":                                     false,
		"reg.example:5000/tenants:t":                                            false,
		"reg.example:5000/tenants/b/vm:t":                                       false,
		"reg.example/tenants/a/vm:t":                                            false, // no port is not port 5000
		"reg.example:443/tenants/a/vm:t":                                        false,
		"reg.example:50000/tenants/a/vm:t":                                      false,
		"reg.example.evil:5000/tenants/a/vm:t":                                  false,
		"evil.reg.example:5000/tenants/a/vm:t":                                  false,
		"other.example/vms/x:t":                                                 true, // the entry's trailing '/' and case do not matter
		"other.example/vms:t":                                                   true,
		"other.example/vmsx:t":                                                  false,
		"other.example:443/vms/x:t":                                             false,
	} {
		err := pol.check(callerAdmin, "image", ref)
		if allowed && err != nil || !allowed && errcode.Of(err) != errcode.Forbidden {
			t.Errorf("%s: %v, want allowed=%v", ref, err, allowed)
		}
	}
	if err := pol.check(callerAdmin, "image", "not a reference"); errcode.Of(err) != errcode.InvalidInput {
		t.Errorf("a malformed reference: %v, want INVALID_INPUT", err)
	}
	if err := pol.check(callerAdmin, "image", ""); err != nil {
		t.Errorf("no image: %v", err)
	}
}

func TestAllowRepositoryRefusesBadEntries(t *testing.T) {
	for _, bad := range []string{"", "reg.example", "reg.example:5000", "reg.example/Tenants", "reg.example/a:tag",
		"reg.example/a@sha256:" + strings.Repeat("ab", 32), "oci:/var/lib/x", "reg.example/a/../b", "reg.example//a"} {
		if _, err := newImagePolicy([]string{bad}, "", t.TempDir()); errcode.Of(err) != errcode.Usage {
			t.Errorf("--allow-repository %q: %v, want USAGE", bad, err)
		}
	}
}

func TestNoAllowRepositoryRefusesEveryRegistry(t *testing.T) {
	pol, err := newImagePolicy(nil, "", t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, ref := range []string{"reg.example/a:t", "localhost:5000/a:t", "oci:/tmp/x:t"} {
		if err := pol.check(callerAdmin, "image", ref); errcode.Of(err) != errcode.Forbidden {
			t.Errorf("%s: %v, want FORBIDDEN", ref, err)
		}
	}
}

// FuzzAllowRepository: whatever the entry, the caller and the reference, a
// match means the reference's host equals the entry's (ignoring case) and
// its repository is the prefix or continues it after a '/', where the
// prefix's {namespace} components are the caller's namespace, a DNS label
// (for an admin: some DNS label): never a '/', "..", or anything else.
func FuzzAllowRepository(f *testing.F) {
	f.Add("reg:5000/tenants/a", "reg:5000/tenants/ab:t", "", true)
	f.Add("reg:5000/tenants/a", "reg:5000/tenants/a/b@sha256:"+strings.Repeat("0", 64), "", true)
	f.Add("Reg/a", "reg/a/b:t", "", true)
	f.Add("[::1]:5000/a", "[::1]:5000/a/b:t", "", true)
	f.Add("reg:5000/vms/{namespace}", "reg:5000/vms/tenant-a/vm:t", "tenant-a", false)
	f.Add("reg:5000/vms/{namespace}", "reg:5000/vms/tenant-a/vm:t", "tenant-b", false)
	f.Add("reg:5000/vms/{namespace}/x", "reg:5000/vms/a/b/x:t", "a/b", false)
	f.Add("reg:5000/{namespace}", "reg:5000/../x:t", "..", false)
	f.Add("reg:5000/vms/{namespace}", "reg:5000/vms/other/vm:t", "", true)
	f.Fuzz(func(t *testing.T, entry, image, ns string, admin bool) {
		p, err := parseRepoPrefix(entry)
		if err != nil {
			return
		}
		c := Caller{Namespace: ns, Admin: admin}
		ref, err := ociimage.ParseReference(image)
		if err != nil || !p.covers(ref, c) {
			return
		}
		host, repo, _ := strings.Cut(image, "/")
		if !strings.EqualFold(host, p.host) {
			t.Fatalf("%q covers %q: other host", entry, image)
		}
		// The prefix the match stands for: the entry, each {namespace}
		// replaced by the reference's component there, which must be the
		// caller's namespace (an admin's: any DNS label).
		got := strings.Split(ref.Repository, "/")
		want := slices.Clone(p.parts)
		for i, part := range want {
			if part != namespacePlaceholder {
				continue
			}
			if i >= len(got) || !isDNSLabel(got[i]) || !admin && got[i] != ns {
				t.Fatalf("%q covers %q for %+v: {namespace} stood for %q", entry, image, c, got[min(i, len(got)-1)])
			}
			want[i] = got[i]
		}
		rest, ok := strings.CutPrefix(repo, strings.Join(want, "/"))
		if !ok || rest != "" && !strings.ContainsAny(rest[:1], "/:@") {
			t.Fatalf("%q covers %q: not on a component boundary", entry, image)
		}
	})
}

func TestLayoutRootRefusesEscapes(t *testing.T) {
	base := t.TempDir()
	root := filepath.Join(base, "layouts")
	state := filepath.Join(root, "agent-state")
	outside := filepath.Join(base, "outside")
	for _, d := range []string{root, state, outside, filepath.Join(root, "tenant-a")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(outside, filepath.Join(root, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "file"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	pol, err := newImagePolicy(nil, root, state)
	if err != nil {
		t.Fatal(err)
	}
	for dir, allowed := range map[string]bool{
		root + "/tenant-a":               true,
		root + "/tenant-a/new/deeper":    true, // not there yet: the agent creates it
		root + "//tenant-a/./x":          true,
		root:                             false, // it holds the state directory
		outside:                          false,
		root + "/../outside":             false,
		root + "/tenant-a/../../outside": false,
		"layouts/tenant-a":               false, // relative
		root + "/link":                   false,
		root + "/link/x":                 false,
		root + "/file/x":                 false,
		state:                            false,
		state + "/ops":                   false,
		base + "/layoutsx":               false,
		"/":                              false,
	} {
		err := pol.check(callerAdmin, "image", "oci:"+dir+":t")
		if allowed && err != nil || !allowed && errcode.Of(err) != errcode.Forbidden {
			t.Errorf("oci:%s: %v, want allowed=%v", dir, err, allowed)
		}
	}
	if _, err := newImagePolicy(nil, state, root); errcode.Of(err) != errcode.Usage {
		t.Errorf("a layout root inside the state directory: %v, want USAGE", err)
	}
	if _, err := newImagePolicy(nil, "layouts", state); errcode.Of(err) != errcode.Usage {
		t.Errorf("a relative layout root: %v, want USAGE", err)
	}
	if nopol, _ := newImagePolicy(nil, "", state); errcode.Of(nopol.check(callerAdmin, "image", "oci:"+root+"/tenant-a:t")) != errcode.Forbidden {
		t.Error("without --layout-root a layout was allowed")
	}
}
