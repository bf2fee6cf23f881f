package agent

// Where the agent lets callers send images, and read them from.
//
// The agent runs as root on the node: an image reference in a request is a
// place the agent writes to (checkpoint) or reads from (restore) with the
// node's credentials. So every reference in a request must be under what
// the node's administrator allowed for that caller:
//
//   - a registry reference under one of --allow-repository HOST[:PORT]/PREFIX:
//     the host and port exactly (the host case-insensitively, as DNS names
//     are; no port equals no port only: reg and reg:443 are different
//     entries, so that an entry never covers a port it does not name), and
//     the repository equal to PREFIX or below it on a path-component
//     boundary (reg/tenants/a allows reg/tenants/a/vm, never
//     reg/tenants/ab). Repository names are lowercase by the distribution
//     spec, and ParseReference refuses any other. A component of PREFIX
//     that is exactly {namespace} stands for the caller's pod namespace
//     (reg/vms/{namespace} gives each tenant its own repositories); it
//     matches one component, never a '/' or "..", and for an admin any
//     namespace (a DNS label). A caller whose namespace is not a DNS label
//     matches no such entry.
//   - an oci: layout below --layout-root, for a caller in a pod below
//     LAYOUT_ROOT/NAMESPACE, its own namespace's directory (admins: anywhere
//     below the root): an absolute path without a ".." component, none of
//     whose existing components is a symbolic link, and never overlapping
//     the agent's --state-dir. ociimage opens the layout by name after this
//     check, so each existing directory from the root down must be one
//     only the agent can change (owned by the agent's user, not writable by
//     group or others): then no one but root can swap a component for a
//     link between the check and the open.
//
// Without --allow-repository every registry reference is refused, and
// without --layout-root every layout.

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// namespacePlaceholder, as a whole component of an --allow-repository
// PREFIX, stands for the caller's pod namespace.
const namespacePlaceholder = "{namespace}"

// dnsLabel is what a namespace is (RFC 1123 label): what a placeholder may
// stand for, and the only namespace a layout directory is made of.
var dnsLabel = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)

func isDNSLabel(s string) bool { return dnsLabel.MatchString(s) }

// repoPrefix is one --allow-repository entry.
type repoPrefix struct {
	host  string   // HOST[:PORT], lowercase
	parts []string // repository prefix components; namespacePlaceholder stands for the caller's namespace
}

func (p repoPrefix) String() string { return p.host + "/" + strings.Join(p.parts, "/") }

// parseRepoPrefix parses HOST[:PORT]/PREFIX with the same rules as an image
// reference, without a tag or digest. {namespace} may be a whole component
// of PREFIX, nowhere else.
func parseRepoPrefix(s string) (repoPrefix, error) {
	bad := errcode.New(errcode.Usage,
		"--allow-repository %q: want HOST[:PORT]/PREFIX without a tag or digest, such as registry.example:5000/vms/tenant-a or registry.example:5000/vms/{namespace}", s)
	host, path, _ := strings.Cut(strings.TrimSuffix(s, "/"), "/")
	parts := strings.Split(path, "/")
	// Parse with a plain label in place of each placeholder: the entry is
	// then an ordinary reference, and no placeholder hides in the host or
	// inside a component.
	plain := slices.Clone(parts)
	for i, c := range plain {
		if c == namespacePlaceholder {
			plain[i] = "ns"
		}
	}
	ref, err := ociimage.ParseReference(host + "/" + strings.Join(plain, "/"))
	if err != nil || ref.IsLayout() || ref.Tag != "" || ref.Digest != "" || ref.Repository != strings.Join(plain, "/") {
		return repoPrefix{}, bad
	}
	return repoPrefix{host: strings.ToLower(ref.Registry), parts: parts}, nil
}

// covers reports whether the registry reference ref is under p for caller c.
func (p repoPrefix) covers(ref ociimage.Reference, c Caller) bool {
	if ref.IsLayout() || strings.ToLower(ref.Registry) != p.host {
		return false
	}
	repo := strings.Split(ref.Repository, "/")
	if len(repo) < len(p.parts) {
		return false
	}
	for i, want := range p.parts {
		switch {
		case want != namespacePlaceholder:
			if repo[i] != want {
				return false
			}
		case c.Admin:
			if !isDNSLabel(repo[i]) {
				return false
			}
		case !isDNSLabel(c.Namespace) || repo[i] != c.Namespace:
			return false
		}
	}
	return true
}

// imagePolicy decides which image references requests may name.
type imagePolicy struct {
	repos      []repoPrefix
	layoutRoot string // clean, absolute, symbolic links resolved; "" for none
	stateDir   string // likewise
}

// newImagePolicy checks the agent's flags. stateDir must exist.
func newImagePolicy(allow []string, layoutRoot, stateDir string) (*imagePolicy, error) {
	pol := &imagePolicy{}
	for _, s := range allow {
		p, err := parseRepoPrefix(s)
		if err != nil {
			return nil, err
		}
		pol.repos = append(pol.repos, p)
	}
	var err error
	if pol.stateDir, err = realDir(stateDir, "--state-dir"); err != nil {
		return nil, err
	}
	if layoutRoot == "" {
		return pol, nil
	}
	if !filepath.IsAbs(layoutRoot) {
		return nil, errcode.New(errcode.Usage, "--layout-root %q is not an absolute path", layoutRoot)
	}
	if pol.layoutRoot, err = realDir(layoutRoot, "--layout-root"); err != nil {
		return nil, err
	}
	if fi, err := os.Lstat(pol.layoutRoot); err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "--layout-root %s", layoutRoot)
	} else if err := agentOnlyDir(pol.layoutRoot, fi); err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "--layout-root %s", layoutRoot)
	}
	if err := safeAncestors(pol.layoutRoot); err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "--layout-root %s", layoutRoot)
	}
	if within(pol.layoutRoot, pol.stateDir) {
		return nil, errcode.New(errcode.Usage, "--layout-root %s is inside --state-dir %s: the agent's journal is no place for images; choose another directory", layoutRoot, stateDir)
	}
	return pol, nil
}

// realDir is dir with its symbolic links resolved; it must be a directory.
func realDir(dir, flag string) (string, error) {
	real, err := filepath.EvalSymlinks(dir)
	if err == nil {
		var fi os.FileInfo
		if fi, err = os.Stat(real); err == nil && !fi.IsDir() {
			err = errors.New("not a directory")
		}
	}
	if err != nil {
		return "", errcode.Wrap(errcode.Usage, err, "%s %s", flag, dir)
	}
	abs, err := filepath.Abs(real)
	if err != nil {
		return "", errcode.Wrap(errcode.Usage, err, "%s %s", flag, dir)
	}
	return abs, nil
}

// check returns FORBIDDEN unless caller c may name the reference s (what
// names the field of the request: "image", "disk image", ...). A malformed
// reference is INVALID_INPUT, as anywhere else. Empty references pass: the
// request does not name that image.
func (pol *imagePolicy) check(c Caller, what, s string) error {
	if s == "" {
		return nil
	}
	ref, err := ociimage.ParseReference(s)
	if err != nil {
		return err
	}
	if ref.IsLayout() {
		return pol.checkLayout(c, what, ref.Layout)
	}
	if slices.ContainsFunc(pol.repos, func(p repoPrefix) bool { return p.covers(ref, c) }) {
		return nil
	}
	if len(pol.repos) == 0 {
		return errcode.New(errcode.Forbidden, "%s %s: this agent pushes to and pulls from no registry (it has no --allow-repository)", what, s)
	}
	names := make([]string, len(pol.repos))
	for i, p := range pol.repos {
		names[i] = p.String()
	}
	return errcode.New(errcode.Forbidden, "%s %s is under none of the repositories this agent allows %s (%s, where {namespace} is the caller's namespace): use one of them",
		what, s, c, strings.Join(names, ", "))
}

// layoutBase is the directory caller c's layouts must be under: the root
// for an admin, the root's directory named after c's namespace otherwise.
func (pol *imagePolicy) layoutBase(c Caller) (string, error) {
	if c.Admin {
		return pol.layoutRoot, nil
	}
	if !isDNSLabel(c.Namespace) {
		return "", errcode.New(errcode.Forbidden, "%s: its namespace is not a DNS label, so it has no directory under the layout root %s; use a registry", c, pol.layoutRoot)
	}
	return filepath.Join(pol.layoutRoot, c.Namespace), nil
}

// checkLayout refuses a layout directory outside the caller's part of the
// layout root, one reached through a symbolic link, one in a directory that
// someone besides the agent could change, and one that overlaps the
// agent's state directory.
func (pol *imagePolicy) checkLayout(c Caller, what, dir string) error {
	if pol.layoutRoot == "" {
		return errcode.New(errcode.Forbidden, "%s oci:%s: this agent writes and reads no OCI layout on the node (it has no --layout-root); use a registry", what, dir)
	}
	base, err := pol.layoutBase(c)
	if err != nil {
		return err
	}
	if !filepath.IsAbs(dir) || slices.Contains(strings.Split(dir, "/"), "..") {
		return errcode.New(errcode.Forbidden, "%s oci:%s: give an absolute path without \"..\" below %s", what, dir, base)
	}
	dir = filepath.Clean(dir)
	if !within(dir, base) {
		return errcode.New(errcode.Forbidden, "%s oci:%s is not under %s, where the agent keeps layouts for %s", what, dir, base, c)
	}
	if within(dir, pol.stateDir) || within(pol.stateDir, dir) {
		return errcode.New(errcode.Forbidden, "%s oci:%s overlaps the agent's state directory: choose another directory under %s", what, dir, base)
	}
	// What exists from the root down must be plain directories only the
	// agent can change: a link there could lead anywhere on the node, and
	// one who may write a directory could put a link there after this
	// check, before ociimage opens the layout by name. What does not exist
	// yet the agent creates itself.
	paths := []string{pol.layoutRoot}
	for part := range strings.SplitSeq(strings.TrimPrefix(dir, pol.layoutRoot), "/") {
		if part != "" {
			paths = append(paths, filepath.Join(paths[len(paths)-1], part))
		}
	}
	for _, p := range paths {
		fi, err := os.Lstat(p)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err == nil {
			err = agentOnlyDir(p, fi)
		}
		if err != nil {
			return errcode.Wrap(errcode.Forbidden, err, "%s oci:%s", what, dir)
		}
	}
	return nil
}

// safeAncestors refuses a directory above the layout root that someone
// besides root and the agent's user could change entries of (a sticky one,
// such as /tmp, lets no one rename what is not theirs): its owner could
// swap the root for a link between a check and an open.
func safeAncestors(root string) error {
	for dir := filepath.Dir(root); ; dir = filepath.Dir(dir) {
		fi, err := os.Stat(dir)
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok || st.Uid != 0 && int(st.Uid) != os.Geteuid() || fi.Mode().Perm()&0o022 != 0 && fi.Mode()&fs.ModeSticky == 0 {
			return fmt.Errorf("%s (mode %v) above it may be changed by someone besides root and the agent: choose a layout root whose parents only root writes", dir, fi.Mode())
		}
		if dir == "/" {
			return nil
		}
	}
}

// agentOnlyDir refuses what is not a directory only the agent's user may
// change: a link, a file, a directory of another user or one its group or
// others may write.
func agentOnlyDir(path string, fi fs.FileInfo) error {
	if !fi.IsDir() {
		return fmt.Errorf("%s is a %s, not a directory; the agent follows no links below the layout root", path, fi.Mode().Type())
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || int(st.Uid) != os.Geteuid() || fi.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("%s (mode %v) may be changed by someone besides the agent: below the layout root only the agent writes (chown it to the agent's user, chmod go-w)", path, fi.Mode())
	}
	return nil
}

// within reports whether p is dir or below it (both clean and absolute).
func within(p, dir string) bool {
	return p == dir || dir == "/" || strings.HasPrefix(p, dir+"/")
}
