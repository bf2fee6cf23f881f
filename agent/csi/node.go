package csi

import (
	"context"
	"log/slog"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
)

// node answers the CSI Node service. An inline ephemeral volume has no
// staging step, no stats and no expansion: publish and unpublish are all.
type node struct {
	csipb.UnimplementedNodeServer
	nodeID  string
	podsDir string
	pub     Publisher
	log     *slog.Logger
}

func (n *node) NodeGetInfo(context.Context, *csipb.NodeGetInfoRequest) (*csipb.NodeGetInfoResponse, error) {
	return &csipb.NodeGetInfoResponse{NodeId: n.nodeID}, nil
}

func (n *node) NodeGetCapabilities(context.Context, *csipb.NodeGetCapabilitiesRequest) (*csipb.NodeGetCapabilitiesResponse, error) {
	return &csipb.NodeGetCapabilitiesResponse{}, nil
}

func (n *node) NodePublishVolume(ctx context.Context, req *csipb.NodePublishVolumeRequest) (*csipb.NodePublishVolumeResponse, error) {
	p, err := checkPublish(req, n.podsDir)
	if err != nil {
		n.log.Warn("csi: publish refused", "volume", clip(req.GetVolumeId(), 80), "error", err)
		return nil, grpcError(err)
	}
	if err := n.pub.Publish(ctx, p); err != nil {
		n.log.Warn("csi: publish failed", "volume", p.VolumeID, "namespace", p.Pod.Namespace, "pod", p.Pod.Name, "image", p.Image, "error", err)
		return nil, grpcError(err)
	}
	n.log.Info("csi: published", "volume", p.VolumeID, "namespace", p.Pod.Namespace, "pod", p.Pod.Name, "image", p.Image)
	return &csipb.NodePublishVolumeResponse{}, nil
}

func (n *node) NodeUnpublishVolume(ctx context.Context, req *csipb.NodeUnpublishVolumeRequest) (*csipb.NodeUnpublishVolumeResponse, error) {
	if err := checkUnpublish(req, n.podsDir); err != nil {
		n.log.Warn("csi: unpublish refused", "volume", clip(req.GetVolumeId(), 80), "error", err)
		return nil, grpcError(err)
	}
	if err := n.pub.Unpublish(ctx, req.GetVolumeId(), req.GetTargetPath()); err != nil {
		n.log.Warn("csi: unpublish failed", "volume", req.GetVolumeId(), "error", err)
		return nil, grpcError(err)
	}
	n.log.Info("csi: unpublished", "volume", req.GetVolumeId())
	return &csipb.NodeUnpublishVolumeResponse{}, nil
}
