package containerd

import (
	"context"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/rootfs"
)

var _ agent.RootfsCapturer = (*Resolver)(nil)

// CaptureRootfs stores the writable layer of the container t names (by its
// containerd ID, as Resolve found it: a container replaced since is not
// captured in its stead) as a container image in repo.
func (r *Resolver) CaptureRootfs(ctx context.Context, t agent.Target, repo ociimage.Repository, progress func(layerBytes int64)) (*rootfs.LayerResult, error) {
	if t.ContainerID == "" {
		return nil, errcode.New(errcode.VMNotFound, "no container ID for the VM of pod %s: resolve it first", t.PodUID)
	}
	return rootfs.CaptureLayer(ctx, r.client, r.namespace, t.ContainerID, repo, rootfs.LayerOptions{Progress: progress})
}
