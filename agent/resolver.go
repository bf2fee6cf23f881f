package agent

import (
	"context"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/snapshot"
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
	// Resolve finds the VM ref names and opens its QMP socket and disk
	// overlay, checked, for one operation, which closes them. An empty or
	// unknown pod UID, or a container or path that does not exist, is
	// VM_NOT_FOUND.
	Resolve(ctx context.Context, ref VMRef) (*Resolved, error)
	// Watch reports containers that are deleted or replaced until ctx ends.
	Watch(ctx context.Context) (<-chan Gone, error)
}

// Resolved is a VM found for one operation: where it is (Target, whose
// paths are for display only) and its files, already opened.
type Resolved struct {
	Target
	snapshot.Handles
}
