package csi

import (
	"context"
	"path"
	"regexp"
	"strings"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Publisher is what the agent does with a checked request: apply its policy
// to the pod's namespace, make sure the node's RAM cache holds the verified
// file, and have the mounter put it at the target. Publish must be
// idempotent and may join a publication already under way: the kubelet
// retries one that outlived its two-minute timeout.
type Publisher interface {
	Publish(ctx context.Context, p Publication) error
	// Unpublish undoes a publication; one unknown (already undone, or never
	// made) is not an error.
	Unpublish(ctx context.Context, volumeID, target string) error
}

// Publication is a NodePublishVolume request once checked.
type Publication struct {
	VolumeID string // csi-<64 hex>, the kubelet's name for this pod's volume
	Target   string // where the kubelet wants it: <pods>/<uid>/volumes/kubernetes.io~csi/<name>/mount
	Pod      Pod    // who asks, as the kubelet says (never as the pod says)
	Image    string // the state image, REPO@sha256:HEX
	ReadOnly bool   // the pod's volume says readOnly: true
}

// Pod is the asking pod as the kubelet reports it with podInfoOnMount.
type Pod struct {
	Namespace, Name, UID, ServiceAccount string
}

// The volume attributes the kubelet adds (podInfoOnMount, ephemeral). It
// writes them after the pod's own, so a pod cannot set them.
const (
	attrPodName        = "csi.storage.k8s.io/pod.name"
	attrPodNamespace   = "csi.storage.k8s.io/pod.namespace"
	attrPodUID         = "csi.storage.k8s.io/pod.uid"
	attrServiceAccount = "csi.storage.k8s.io/serviceAccount.name"
	attrEphemeral      = "csi.storage.k8s.io/ephemeral"
	// AttrImage is the one attribute a pod gives: the state image by digest.
	AttrImage = "image"
)

// Bounds on what a request may carry: a handful of short attributes.
const (
	maxAttributes = 16
	maxAttrValue  = 1024
	maxImageRef   = 512
)

var (
	volumeIDRe = regexp.MustCompile(`^csi-[0-9a-f]{64}$`)
	podUIDRe   = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)
	dnsLabelRe = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)
	// A DNS subdomain (pod and service account names), at most 253 bytes.
	dnsSubdomainRe = regexp.MustCompile(`^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$`)
	digestRefRe    = regexp.MustCompile(`^[^@\s]+@sha256:[0-9a-f]{64}$`)
)

// checkPublish turns a NodePublishVolume request into a Publication, or says
// what is wrong with it. podsDir is the kubelet's pods directory.
func checkPublish(req *csipb.NodePublishVolumeRequest, podsDir string) (Publication, error) {
	var p Publication
	if err := checkVolumeID(req.GetVolumeId()); err != nil {
		return p, err
	}
	attrs := req.GetVolumeContext()
	if err := checkAttributes(attrs); err != nil {
		return p, err
	}
	if attrs[attrEphemeral] != "true" {
		return p, errcode.New(errcode.Usage, "%s serves only inline ephemeral volumes (a csi: volume in the pod), and the kubelet's CSIDriver object must have podInfoOnMount: true", DriverName)
	}
	pod, err := checkPod(attrs)
	if err != nil {
		return p, err
	}
	if err := checkCapability(req.GetVolumeCapability()); err != nil {
		return p, err
	}
	image := attrs[AttrImage]
	if len(image) > maxImageRef || !digestRefRe.MatchString(image) {
		return p, errcode.New(errcode.Usage, "volume attribute %q must name the state image by digest (REPO@sha256:<64 hex>), got %q", AttrImage, clip(image, 80))
	}
	target := req.GetTargetPath()
	if err := checkTarget(target, podsDir, pod.UID); err != nil {
		return p, err
	}
	return Publication{VolumeID: req.GetVolumeId(), Target: target, Pod: pod, Image: image, ReadOnly: req.GetReadonly()}, nil
}

// checkUnpublish checks a NodeUnpublishVolume request: the volume id and a
// target of the kubelet's form for some pod.
func checkUnpublish(req *csipb.NodeUnpublishVolumeRequest, podsDir string) error {
	if err := checkVolumeID(req.GetVolumeId()); err != nil {
		return err
	}
	return checkTarget(req.GetTargetPath(), podsDir, "")
}

func checkVolumeID(id string) error {
	if !volumeIDRe.MatchString(id) {
		return errcode.New(errcode.InvalidInput, "volume id %q is not the kubelet's csi-<sha256> name of an inline volume", clip(id, 80))
	}
	return nil
}

// checkAttributes bounds the attributes and refuses keys vmsnap does not
// know, so that a typo in a pod's volumeAttributes is an error, not ignored.
func checkAttributes(attrs map[string]string) error {
	if len(attrs) > maxAttributes {
		return errcode.New(errcode.InvalidInput, "%d volume attributes: at most %d", len(attrs), maxAttributes)
	}
	for k, v := range attrs {
		if len(v) > maxAttrValue {
			return errcode.New(errcode.InvalidInput, "volume attribute %q is %d bytes long: at most %d", clip(k, 80), len(v), maxAttrValue)
		}
		switch k {
		case AttrImage, attrPodName, attrPodNamespace, attrPodUID, attrServiceAccount, attrEphemeral:
		default:
			if !strings.HasPrefix(k, "csi.storage.k8s.io/") {
				return errcode.New(errcode.Usage, "unknown volume attribute %q: %s takes only %q", clip(k, 80), DriverName, AttrImage)
			}
		}
	}
	return nil
}

func checkPod(attrs map[string]string) (Pod, error) {
	pod := Pod{Namespace: attrs[attrPodNamespace], Name: attrs[attrPodName], UID: attrs[attrPodUID], ServiceAccount: attrs[attrServiceAccount]}
	switch {
	case !dnsLabelRe.MatchString(pod.Namespace):
		return pod, errcode.New(errcode.InvalidInput, "the kubelet reported no pod namespace (%q): the CSIDriver %s needs podInfoOnMount: true", clip(pod.Namespace, 80), DriverName)
	case !podUIDRe.MatchString(pod.UID):
		return pod, errcode.New(errcode.InvalidInput, "the kubelet reported no pod UID (%q): the CSIDriver %s needs podInfoOnMount: true", clip(pod.UID, 80), DriverName)
	case len(pod.Name) > 253 || !dnsSubdomainRe.MatchString(pod.Name):
		return pod, errcode.New(errcode.InvalidInput, "pod name %q is not a Kubernetes object name", clip(pod.Name, 80))
	case pod.ServiceAccount != "" && (len(pod.ServiceAccount) > 253 || !dnsSubdomainRe.MatchString(pod.ServiceAccount)):
		return pod, errcode.New(errcode.InvalidInput, "service account %q is not a Kubernetes object name", clip(pod.ServiceAccount, 80))
	}
	return pod, nil
}

// checkCapability accepts a filesystem volume with no mount options: the
// mount's flags are vmsnap's to choose (read-only, nosuid, nodev, noexec).
func checkCapability(vc *csipb.VolumeCapability) error {
	if vc == nil || vc.GetMount() == nil {
		return errcode.New(errcode.Usage, "%s publishes a file in a directory: use a filesystem volume, not a block one", DriverName)
	}
	if flags := vc.GetMount().GetMountFlags(); len(flags) > 0 {
		return errcode.New(errcode.Usage, "mount options %q are not accepted: %s chooses the mount's options itself", clip(strings.Join(flags, ","), 80), DriverName)
	}
	return nil
}

// checkTarget accepts exactly the kubelet's target of an inline CSI volume:
// <podsDir>/<pod uid>/volumes/kubernetes.io~csi/<volume name>/mount, clean
// and absolute, for the given pod (any pod when uid is ""). The mounter
// checks it again by descriptors; this check is what the agent can say
// about the request without opening anything.
func checkTarget(target, podsDir, uid string) error {
	bad := func(why string) error {
		return errcode.New(errcode.InvalidInput, "target path %q %s: %s mounts only at the kubelet's <pods>/<uid>/volumes/kubernetes.io~csi/<name>/mount under %s", clip(target, 160), why, DriverName, podsDir)
	}
	if len(target) > 4096 || !path.IsAbs(target) || path.Clean(target) != target {
		return bad("is not a clean absolute path")
	}
	rest, ok := strings.CutPrefix(target, strings.TrimSuffix(podsDir, "/")+"/")
	if !ok {
		return bad("is outside the kubelet's pods directory")
	}
	parts := strings.Split(rest, "/")
	if len(parts) != 5 || parts[1] != "volumes" || parts[2] != "kubernetes.io~csi" || parts[4] != "mount" {
		return bad("does not have the kubelet's form")
	}
	if !podUIDRe.MatchString(parts[0]) || !dnsLabelRe.MatchString(parts[3]) {
		return bad("names no pod UID or volume name")
	}
	if uid != "" && parts[0] != uid {
		return bad("belongs to another pod than " + uid)
	}
	return nil
}
