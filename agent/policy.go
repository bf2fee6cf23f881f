package agent

// Where the agent lets callers send images, and read them from.
//
// The agent runs as root on the node: an image reference in a request is a
// place the agent writes to (checkpoint) or reads from (restore) with the
// node's credentials. So every reference in a request must be under what
// the node's administrator allowed, whoever the caller is:
//
//   - a registry reference under one of --allow-repository HOST[:PORT]/PREFIX:
//     the host and port exactly (the host case-insensitively, as DNS names
//     are; no port equals no port only: reg and reg:443 are different
//     entries, so that an entry never covers a port it does not name), and
//     the repository equal to PREFIX or below it on a path-component
//     boundary (reg/tenants/a allows reg/tenants/a/vm, never
//     reg/tenants/ab). Repository names are lowercase by the distribution
//     spec, and ParseReference refuses any other.
//   - an oci: layout below --layout-root: an absolute path without a ".."
//     component, none of whose existing components below the root is a
//     symbolic link, and never overlapping the agent's --state-dir.
//
// Without --allow-repository every registry reference is refused, and
// without --layout-root every layout.

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
)

// repoPrefix is one --allow-repository entry.
type repoPrefix struct {
	host string // HOST[:PORT], lowercase
	path string // repository prefix, without a trailing '/'
}

func (p repoPrefix) String() string { return p.host + "/" + p.path }

// parseRepoPrefix parses HOST[:PORT]/PREFIX with the same rules as an image
// reference, without a tag or digest.
func parseRepoPrefix(s string) (repoPrefix, error) {
	ref, err := ociimage.ParseReference(strings.TrimSuffix(s, "/"))
	if err != nil || ref.IsLayout() || ref.Tag != "" || ref.Digest != "" {
		return repoPrefix{}, errcode.New(errcode.Usage,
			"--allow-repository %q: want HOST[:PORT]/PREFIX without a tag or digest, such as registry.example:5000/vms/tenant-a", s)
	}
	return repoPrefix{host: strings.ToLower(ref.Registry), path: ref.Repository}, nil
}

// covers reports whether the registry reference ref is under p.
func (p repoPrefix) covers(ref ociimage.Reference) bool {
	if ref.IsLayout() || strings.ToLower(ref.Registry) != p.host {
		return false
	}
	return ref.Repository == p.path || strings.HasPrefix(ref.Repository, p.path+"/")
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

// check returns FORBIDDEN unless the reference s (what names the field
// of the request: "image", "disk image", ...) is allowed. A malformed
// reference is INVALID_INPUT, as anywhere else. Empty references pass: the
// request does not name that image.
func (pol *imagePolicy) check(what, s string) error {
	if s == "" {
		return nil
	}
	ref, err := ociimage.ParseReference(s)
	if err != nil {
		return err
	}
	if ref.IsLayout() {
		return pol.checkLayout(what, ref.Layout)
	}
	if slices.ContainsFunc(pol.repos, func(p repoPrefix) bool { return p.covers(ref) }) {
		return nil
	}
	if len(pol.repos) == 0 {
		return errcode.New(errcode.Forbidden, "%s %s: this agent pushes to and pulls from no registry (it has no --allow-repository)", what, s)
	}
	names := make([]string, len(pol.repos))
	for i, p := range pol.repos {
		names[i] = p.String()
	}
	return errcode.New(errcode.Forbidden, "%s %s is under none of the repositories this agent allows (%s): use one of them", what, s, strings.Join(names, ", "))
}

// checkLayout refuses a layout directory outside the layout root, one
// reached through a symbolic link below the root, and one that overlaps
// the agent's state directory.
func (pol *imagePolicy) checkLayout(what, dir string) error {
	if pol.layoutRoot == "" {
		return errcode.New(errcode.Forbidden, "%s oci:%s: this agent writes and reads no OCI layout on the node (it has no --layout-root); use a registry", what, dir)
	}
	if !filepath.IsAbs(dir) || slices.Contains(strings.Split(dir, "/"), "..") {
		return errcode.New(errcode.Forbidden, "%s oci:%s: give an absolute path without \"..\" below the layout root %s", what, dir, pol.layoutRoot)
	}
	dir = filepath.Clean(dir)
	if !within(dir, pol.layoutRoot) {
		return errcode.New(errcode.Forbidden, "%s oci:%s is not under the layout root %s", what, dir, pol.layoutRoot)
	}
	if within(dir, pol.stateDir) || within(pol.stateDir, dir) {
		return errcode.New(errcode.Forbidden, "%s oci:%s overlaps the agent's state directory: choose another directory under %s", what, dir, pol.layoutRoot)
	}
	// What exists below the root must be plain directories: a link there
	// could lead anywhere on the node. What does not exist yet the agent
	// creates itself.
	cur := pol.layoutRoot
	for part := range strings.SplitSeq(strings.TrimPrefix(strings.TrimPrefix(dir, pol.layoutRoot), "/"), "/") {
		if part == "" {
			continue
		}
		cur = filepath.Join(cur, part)
		fi, err := os.Lstat(cur)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return errcode.Wrap(errcode.Forbidden, err, "%s oci:%s", what, dir)
		}
		if !fi.IsDir() {
			return errcode.New(errcode.Forbidden, "%s oci:%s: %s is a %s, not a directory; the agent follows no links below the layout root", what, dir, cur, fi.Mode().Type())
		}
	}
	return nil
}

// within reports whether p is dir or below it (both clean and absolute).
func within(p, dir string) bool {
	return p == dir || dir == "/" || strings.HasPrefix(p, dir+"/")
}
