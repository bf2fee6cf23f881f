package mounter

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"regexp"
	"strings"

	"github.com/vmsnap/vmsnap/internal/beneath"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// targetPattern is a CSI volume's target below the pods directory:
// POD_UID/volumes/kubernetes.io~csi/VOLUME_NAME/mount, a pod UID as the API
// server makes them and a volume name as the API server admits them.
var targetPattern = regexp.MustCompile(`^([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})` +
	`/volumes/kubernetes\.io~csi/([a-z0-9][-a-z0-9.]{0,251}[a-z0-9]|[a-z0-9])/mount$`)

// targetLeaf is the last component, which the plugin creates and removes
// (the kubelet creates its parent only).
const targetLeaf = "mount"

// VolumeHandle is the volume id the kubelet gives an inline (ephemeral)
// CSI volume: csi- and the hex SHA-256 of the pod UID followed by the
// volume's name (k8s.io/kubernetes pkg/volume/csi makeVolumeHandle).
func VolumeHandle(podUID, volumeName string) string {
	return fmt.Sprintf("csi-%x", sha256.Sum256([]byte(podUID+volumeName)))
}

// checkTarget checks a target path lexically: below the pods directory,
// of the kubelet's form, and the volume's id volumeID. It returns the path
// of the target's parent relative to the pods directory, and the UID of
// the pod the target is in.
func (s *Server) checkTarget(target, volumeID string) (rel, podUID string, err error) {
	rel, ok := strings.CutPrefix(target, s.cfg.PodsDir+"/")
	m := targetPattern.FindStringSubmatch(rel)
	if !ok || m == nil {
		return "", "", errcode.New(errcode.Forbidden, "target %q is not %s/POD_UID/volumes/kubernetes.io~csi/VOLUME/mount: the mounter mounts only onto kubelet CSI volume targets",
			target, s.cfg.PodsDir)
	}
	if want := VolumeHandle(m[1], m[2]); volumeID != want {
		return "", "", errcode.New(errcode.Forbidden, "volume id %q is not the kubelet's for volume %q of pod %s (%s)", volumeID, m[2], m[1], want)
	}
	return strings.TrimSuffix(rel, "/"+targetLeaf), m[1], nil
}

// openParent opens the target's parent, the volume's directory that the
// kubelet made, beneath the pods directory: no link, no mount point on the
// way. os.ErrNotExist when the kubelet has not made (or has removed) it.
func (s *Server) openParent(rel string) (*os.File, error) {
	dir, err := beneath.Open(s.pods, rel, s.cfg.PodsDir+"/"+rel)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "the kubelet has not made the volume directory")
	}
	if err != nil {
		return nil, errcode.Wrap(errcode.Forbidden, err, "opening the volume directory beneath the kubelet pods directory (no link, no mount point on the way)")
	}
	if t, err := beneath.Type(dir); err != nil || !t.IsDir() {
		dir.Close()
		return nil, errcode.New(errcode.Forbidden, "%s is not a directory", dir.Name())
	}
	return dir, nil
}

// openTarget opens the target directory in parent: the root of what is
// mounted there, if anything is.
func openTarget(parent *os.File) (*os.File, error) {
	t, err := beneath.OpenMountPoint(parent, targetLeaf, parent.Name()+"/"+targetLeaf)
	if err != nil {
		return nil, errcode.Wrap(errcode.Forbidden, err, "opening the volume's target directory")
	}
	return t, nil
}
