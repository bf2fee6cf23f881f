package containerd

import (
	"context"

	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

var _ agent.CallerIdentifier = (*Resolver)(nil)

// CallerContainer finds which of the containers ids (named by the calling
// process's cgroups) runs the process pid: the first that containerd knows
// and whose task lists pid among its processes. An ID containerd does not
// know is skipped (a cgroup of something else on the node). A container it
// knows that does not hold pid is FORBIDDEN: the process only sits in a
// cgroup named like it, and the agent will not guess.
func (r *Resolver) CallerContainer(ctx context.Context, pid int, ids []string) (agent.CallerContainer, bool, error) {
	ctx = namespaces.WithNamespace(ctx, r.namespace)
	for _, id := range ids {
		c, err := r.client.ContainerService().Get(ctx, id)
		if errdefs.IsNotFound(err) {
			continue
		}
		if err != nil {
			return agent.CallerContainer{}, false, errcode.Wrap(errcode.Internal, err, "asking containerd for container %s", shortID(id))
		}
		resp, err := r.client.TaskService().ListPids(ctx, &tasksapi.ListPidsRequest{ContainerID: id})
		if err != nil && !errdefs.IsNotFound(err) {
			return agent.CallerContainer{}, false, errcode.Wrap(errcode.Internal, err, "asking containerd for the processes of container %s", shortID(id))
		}
		for _, p := range resp.GetProcesses() {
			if int(p.Pid) == pid {
				return agent.CallerContainer{
					ID: id, PodNamespace: c.Labels[LabelPodNamespace], PodName: c.Labels[LabelPodName],
					PodUID: c.Labels[LabelPodUID], Name: c.Labels[LabelContainerName],
				}, true, nil
			}
		}
		return agent.CallerContainer{}, false, errcode.New(errcode.Forbidden,
			"the agent cannot tell which pod you are: your process (pid %d) is in the cgroup of container %s but not one of its processes", pid, shortID(id))
	}
	return agent.CallerContainer{}, false, nil
}
