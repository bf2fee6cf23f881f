package agent

import (
	"context"

	"github.com/vmsnap/vmsnap/agent/api"
)

// VMRef and Target are the API's types: see package api.
type (
	VMRef  = api.VMRef
	Target = api.Target
)

// Gone reports that the container behind a VM was deleted or replaced.
type Gone struct {
	PodUID      string
	Container   string
	ContainerID string
}

// Resolver finds VMs on this node. The containerd implementation lives in
// agent/containerd; tests use a static one.
type Resolver interface {
	// Resolve maps a VMRef to host paths. An empty or unknown pod UID, or a
	// container or path that does not exist, is VM_NOT_FOUND.
	Resolve(ctx context.Context, ref VMRef) (Target, error)
	// Watch reports containers that are deleted or replaced until ctx ends.
	Watch(ctx context.Context) (<-chan Gone, error)
}
