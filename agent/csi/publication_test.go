package csi

import (
	"strings"
	"testing"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

const (
	testPods  = "/var/lib/kubelet/pods"
	testUID   = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
	testVolID = "csi-" + "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	testImage = "registry.example:5000/vms/state@sha256:" + "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
)

func testTarget(uid string) string {
	return testPods + "/" + uid + "/volumes/kubernetes.io~csi/ram/mount"
}

// goodPublish is a request as the kubelet sends it for a restore pod's
// inline volume.
func goodPublish() *csipb.NodePublishVolumeRequest {
	return &csipb.NodePublishVolumeRequest{
		VolumeId:   testVolID,
		TargetPath: testTarget(testUID),
		VolumeCapability: &csipb.VolumeCapability{
			AccessType: &csipb.VolumeCapability_Mount{Mount: &csipb.VolumeCapability_MountVolume{}},
			AccessMode: &csipb.VolumeCapability_AccessMode{Mode: csipb.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		},
		Readonly: true,
		VolumeContext: map[string]string{
			AttrImage:          testImage,
			attrEphemeral:      "true",
			attrPodName:        "restore-0",
			attrPodNamespace:   "team-a",
			attrPodUID:         testUID,
			attrServiceAccount: "default",
		},
	}
}

func TestCheckPublishAcceptsTheKubeletsRequest(t *testing.T) {
	p, err := checkPublish(goodPublish(), testPods)
	if err != nil {
		t.Fatal(err)
	}
	want := Publication{VolumeID: testVolID, Target: testTarget(testUID), Image: testImage, ReadOnly: true,
		Pod: Pod{Namespace: "team-a", Name: "restore-0", UID: testUID, ServiceAccount: "default"}}
	if p != want {
		t.Fatalf("got %+v\nwant %+v", p, want)
	}
}

// Each case is a request a hostile or mistaken pod (or a confused kubelet)
// could produce; every one must be refused with the code given, and the
// message must say what was wrong.
func TestCheckPublishRefuses(t *testing.T) {
	otherUID := "11111111-2222-3333-4444-555555555555"
	cases := []struct {
		name   string
		mutate func(r *csipb.NodePublishVolumeRequest)
		code   errcode.Code
		says   string
	}{
		{"volume id not the kubelet's", func(r *csipb.NodePublishVolumeRequest) { r.VolumeId = "my-volume" }, errcode.InvalidInput, "volume id"},
		{"volume id with a path", func(r *csipb.NodePublishVolumeRequest) { r.VolumeId = "csi-../../etc" }, errcode.InvalidInput, "volume id"},
		{"not ephemeral", func(r *csipb.NodePublishVolumeRequest) { delete(r.VolumeContext, attrEphemeral) }, errcode.Usage, "inline ephemeral"},
		{"no pod info", func(r *csipb.NodePublishVolumeRequest) { delete(r.VolumeContext, attrPodNamespace) }, errcode.InvalidInput, "podInfoOnMount"},
		{"namespace not a label", func(r *csipb.NodePublishVolumeRequest) { r.VolumeContext[attrPodNamespace] = "../kube-system" }, errcode.InvalidInput, "namespace"},
		{"uid not a uid", func(r *csipb.NodePublishVolumeRequest) { r.VolumeContext[attrPodUID] = "x" }, errcode.InvalidInput, "pod UID"},
		{"pod name", func(r *csipb.NodePublishVolumeRequest) { r.VolumeContext[attrPodName] = "A/B" }, errcode.InvalidInput, "pod name"},
		{"unknown attribute", func(r *csipb.NodePublishVolumeRequest) { r.VolumeContext["imgae"] = testImage }, errcode.Usage, "unknown volume attribute"},
		{"image by tag", func(r *csipb.NodePublishVolumeRequest) {
			r.VolumeContext[AttrImage] = "registry.example/vms/state:latest"
		}, errcode.Usage, "by digest"},
		{"image with short digest", func(r *csipb.NodePublishVolumeRequest) { r.VolumeContext[AttrImage] = "r/s@sha256:abc" }, errcode.Usage, "by digest"},
		{"no image", func(r *csipb.NodePublishVolumeRequest) { delete(r.VolumeContext, AttrImage) }, errcode.Usage, "by digest"},
		{"too many attributes", func(r *csipb.NodePublishVolumeRequest) {
			for i := range maxAttributes {
				r.VolumeContext["csi.storage.k8s.io/x"+strings.Repeat("y", i)] = "z"
			}
		}, errcode.InvalidInput, "volume attributes"},
		{"oversized attribute", func(r *csipb.NodePublishVolumeRequest) {
			r.VolumeContext[AttrImage] = strings.Repeat("a", maxAttrValue+1)
		}, errcode.InvalidInput, "bytes long"},
		{"block volume", func(r *csipb.NodePublishVolumeRequest) {
			r.VolumeCapability.AccessType = &csipb.VolumeCapability_Block{Block: &csipb.VolumeCapability_BlockVolume{}}
		}, errcode.Usage, "filesystem volume"},
		{"no capability", func(r *csipb.NodePublishVolumeRequest) { r.VolumeCapability = nil }, errcode.Usage, "filesystem volume"},
		{"mount options", func(r *csipb.NodePublishVolumeRequest) {
			r.VolumeCapability.GetMount().MountFlags = []string{"rw", "suid"}
		}, errcode.Usage, "mount options"},
		{"target with ..", func(r *csipb.NodePublishVolumeRequest) {
			r.TargetPath = testPods + "/" + testUID + "/volumes/kubernetes.io~csi/ram/mount/../../../../../../etc"
		}, errcode.InvalidInput, "clean absolute"},
		{"target outside the pods dir", func(r *csipb.NodePublishVolumeRequest) { r.TargetPath = "/etc" }, errcode.InvalidInput, "outside"},
		{"target beside the pods dir", func(r *csipb.NodePublishVolumeRequest) {
			r.TargetPath = testPods + "-evil/" + testUID + "/volumes/kubernetes.io~csi/ram/mount"
		}, errcode.InvalidInput, "outside"},
		{"target relative", func(r *csipb.NodePublishVolumeRequest) { r.TargetPath = "pods/x/mount" }, errcode.InvalidInput, "clean absolute"},
		{"target of another volume plugin", func(r *csipb.NodePublishVolumeRequest) {
			r.TargetPath = testPods + "/" + testUID + "/volumes/kubernetes.io~empty-dir/ram/mount"
		}, errcode.InvalidInput, "form"},
		{"target deeper", func(r *csipb.NodePublishVolumeRequest) {
			r.TargetPath = testPods + "/" + testUID + "/volumes/kubernetes.io~csi/ram/mount/x"
		}, errcode.InvalidInput, "form"},
		{"target of another pod", func(r *csipb.NodePublishVolumeRequest) { r.TargetPath = testTarget(otherUID) }, errcode.InvalidInput, "another pod"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := goodPublish()
			c.mutate(r)
			_, err := checkPublish(r, testPods)
			if err == nil {
				t.Fatal("accepted")
			}
			if errcode.Of(err) != c.code || !strings.Contains(err.Error(), c.says) {
				t.Fatalf("got %s %v, want %s mentioning %q", errcode.Of(err), err, c.code, c.says)
			}
		})
	}
}

func TestCheckUnpublishWantsTheKubeletsForm(t *testing.T) {
	ok := &csipb.NodeUnpublishVolumeRequest{VolumeId: testVolID, TargetPath: testTarget(testUID)}
	if err := checkUnpublish(ok, testPods); err != nil {
		t.Fatal(err)
	}
	for _, target := range []string{"/", "/etc", testPods, testTarget(testUID) + "/..", testPods + "/" + testUID + "/volumes/kubernetes.io~csi/ram"} {
		if err := checkUnpublish(&csipb.NodeUnpublishVolumeRequest{VolumeId: testVolID, TargetPath: target}, testPods); err == nil {
			t.Errorf("unpublish of %q accepted", target)
		}
	}
	if err := checkUnpublish(&csipb.NodeUnpublishVolumeRequest{VolumeId: "csi-x", TargetPath: testTarget(testUID)}, testPods); err == nil {
		t.Error("unpublish of a bad volume id accepted")
	}
}
