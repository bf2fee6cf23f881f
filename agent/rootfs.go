package agent

import (
	"context"

	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/rootfs"
)

// RootfsCapturer is an optional extension of Resolver, found by type
// assertion: a resolver that can reach the container behind a Target
// (agent/containerd's) captures its writable layer as a container image in
// repo. A checkpoint request with a rootfsImage needs it.
type RootfsCapturer interface {
	CaptureRootfs(ctx context.Context, t Target, repo ociimage.Repository, progress func(layerBytes int64)) (*rootfs.LayerResult, error)
}
