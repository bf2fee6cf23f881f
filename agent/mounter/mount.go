package mounter

import (
	"errors"
	"io/fs"
	"os"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/internal/beneath"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// publish bind-mounts the publication r.Source onto r.Target, read-only if
// r.ReadOnly, always nosuid, nodev and noexec, creating the target
// directory. Publishing the same source with the same mode again succeeds
// and changes nothing (the kubelet retries); a target that holds anything
// else is refused.
func (s *Server) publish(r PublishRequest) error {
	rel, podUID, err := s.checkTarget(r.Target, r.VolumeID)
	if err != nil {
		return err
	}
	if podUID != r.PodUID {
		return errcode.New(errcode.Forbidden, "target %q is pod %s's, not the requesting pod's (%q)", r.Target, podUID, r.PodUID)
	}
	defer s.locks.lock(r.Target)()
	src, err := s.openSource(r.Source, r.VolumeID)
	if err != nil {
		return err
	}
	defer src.Close()
	parent, err := s.openParent(rel)
	if err != nil {
		return err
	}
	defer parent.Close()
	if err := unix.Mkdirat(int(parent.Fd()), targetLeaf, 0o750); err != nil && !errors.Is(err, unix.EEXIST) {
		return errcode.Wrap(errcode.Internal, err, "creating the volume's target directory %s", r.Target)
	}
	t, err := openTarget(parent)
	if err != nil {
		return err
	}
	defer t.Close()
	if s.afterTargetOpen != nil {
		s.afterTargetOpen()
	}
	mounted, err := isMounted(parent, t)
	if err != nil {
		return err
	}
	if mounted {
		return samePublication(t, src, r)
	}
	return bindOnto(src, t, r.ReadOnly)
}

// mountFlags are the attributes of every publication; RDONLY is added for
// a read-only one.
const mountFlags = unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV | unix.MOUNT_ATTR_NOEXEC

// bindOnto clones the mount of src (the directory alone, no submounts),
// sets its attributes while it is detached, and attaches it onto the
// directory t is open on: whatever t's name leads to by now. The clone is
// made private first, so that it leaves the source mount's peer group (a
// mount below a publication never shows in the cache, nor the other way
// round); attached below the kubelet's shared directory it then gets a
// peer group of its own, and so still reaches the host.
func bindOnto(src, t *os.File, readOnly bool) error {
	tree, err := unix.OpenTree(int(src.Fd()), "", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_EMPTY_PATH)
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "cloning the publication %s (open_tree)", src.Name())
	}
	defer unix.Close(tree)
	attr := uint64(mountFlags)
	if readOnly {
		attr |= unix.MOUNT_ATTR_RDONLY
	}
	if err := unix.MountSetattr(tree, "", unix.AT_EMPTY_PATH, &unix.MountAttr{Attr_set: attr, Propagation: unix.MS_PRIVATE}); err != nil {
		return errcode.Wrap(errcode.Internal, err, "setting the publication's mount attributes (mount_setattr)")
	}
	if err := unix.MoveMount(tree, "", int(t.Fd()), "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		return errcode.Wrap(errcode.Internal, err, "mounting the publication onto %s (move_mount)", t.Name())
	}
	return nil
}

// isMounted says whether something is mounted on the target: its
// descriptor is then on another mount than its parent's.
func isMounted(parent, t *os.File) (bool, error) {
	p, err := fdInfo(parent)
	if err != nil {
		return false, errcode.Wrap(errcode.Internal, err, "reading the volume directory's mount")
	}
	m, err := fdInfo(t)
	if err != nil {
		return false, errcode.Wrap(errcode.Internal, err, "reading the target's mount")
	}
	return p.mountID != m.mountID, nil
}

// samePublication returns nil if the mount on t is src's directory with
// the attributes r asks for: an earlier publish of the same request.
func samePublication(t, src *os.File, r PublishRequest) error {
	got, err := fdInfo(t)
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "reading the target's mount")
	}
	want, err := fdInfo(src)
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "reading the publication's mount")
	}
	gotMount, err := findMount(got.mountID)
	if err != nil {
		return err
	}
	wantMount, err := findMount(want.mountID)
	if err != nil {
		return err
	}
	mode := "rw"
	if r.ReadOnly {
		mode = "ro"
	}
	if got.ino != want.ino || gotMount.dev != wantMount.dev || !gotMount.has(mode, "nosuid", "nodev", "noexec") {
		return errcode.New(errcode.Busy, "target %s already holds another mount (not %s %s): unpublish it first", r.Target, r.Source, mode)
	}
	return nil
}

// maxStacked bounds the mounts Unpublish removes from one target.
const maxStacked = 8

// unpublish unmounts whatever is mounted on r.Target and removes the
// directory. A target already gone, or never mounted, is fine. The unmount
// (MNT_DETACH through the descriptor's /proc/self/fd link) asks nothing of
// the mounted file system, so a FUSE mount whose server is dead or stalled
// does not hang it.
func (s *Server) unpublish(r UnpublishRequest) error {
	rel, _, err := s.checkTarget(r.Target, r.VolumeID)
	if err != nil {
		return err
	}
	defer s.locks.lock(r.Target)()
	parent, err := s.openParent(rel)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer parent.Close()
	for range maxStacked {
		done, err := unmountOne(parent)
		if err != nil || done {
			return err
		}
	}
	return errcode.New(errcode.Internal, "target %s still holds mounts after %d unmounts", r.Target, maxStacked)
}

// unmountOne unmounts the top mount on the target; with none left it
// removes the directory and reports done.
func unmountOne(parent *os.File) (done bool, err error) {
	t, err := openTarget(parent)
	if errors.Is(err, fs.ErrNotExist) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	defer t.Close()
	mounted, err := isMounted(parent, t)
	if err != nil {
		return false, err
	}
	if !mounted {
		err := unix.Unlinkat(int(parent.Fd()), targetLeaf, unix.AT_REMOVEDIR)
		if err != nil && !errors.Is(err, unix.ENOENT) {
			return false, errcode.Wrap(errcode.Internal, err, "removing the target directory %s", t.Name())
		}
		return true, nil
	}
	if err := unix.Unmount(beneath.ProcPath(t), unix.MNT_DETACH); err != nil {
		return false, errcode.Wrap(errcode.Internal, err, "unmounting %s", t.Name())
	}
	return false, nil
}
