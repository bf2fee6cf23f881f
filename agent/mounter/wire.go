package mounter

import "github.com/vmsnap/vmsnap/agent/api"

// Version is the protocol's version: a request with another is refused
// with a message naming both, so that an agent and a mounter of different
// releases fail clearly rather than misread each other.
const Version = 1

// MaxMessage bounds one request or response (a SOCK_SEQPACKET message):
// a publish request is a few hundred bytes.
const MaxMessage = 8 << 10

// The operations.
const (
	opPublish   = "publish"
	opUnpublish = "unpublish"
	opPutFUSE   = "put-fuse-fd" // the message carries the descriptor
	opGetFUSE   = "get-fuse-fd" // the response carries a duplicate
)

// PublishRequest asks for Source to be bind-mounted onto Target.
type PublishRequest struct {
	// VolumeID is the CSI volume id: the last component of Source.
	VolumeID string `json:"volumeID"`
	// PodUID is the pod whose volume Target is: the kubelet's
	// csi.storage.k8s.io/pod.uid, which must be Target's pod directory.
	PodUID string `json:"podUID"`
	// Target is NodePublishVolume's target path:
	// PODS/POD_UID/volumes/kubernetes.io~csi/VOLUME_NAME/mount.
	Target string `json:"target"`
	// Source is the publication directory, below one of the mounter's
	// publication roots, named VolumeID.
	Source string `json:"source"`
	// ReadOnly makes the mount read-only. It is always nosuid, nodev and
	// noexec.
	ReadOnly bool `json:"readOnly"`
}

// UnpublishRequest asks for Target to be unmounted and removed: what
// NodeUnpublishVolume gives (the pod is Target's).
type UnpublishRequest struct {
	VolumeID string `json:"volumeID"`
	Target   string `json:"target"`
}

type request struct {
	Version   int               `json:"v"`
	Op        string            `json:"op"`
	Publish   *PublishRequest   `json:"publish,omitempty"`
	Unpublish *UnpublishRequest `json:"unpublish,omitempty"`
}

type response struct {
	Version int        `json:"v"`
	Error   *api.Error `json:"error,omitempty"`
}
