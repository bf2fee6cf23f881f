package main

import (
	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/agent/manifests"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

func newManifestsCmd(out *globalOutput) *cobra.Command {
	var o manifests.Options
	var parts []string
	c := &cobra.Command{
		Use:   "manifests [--part agent|job|restore]...",
		Short: "Print the Kubernetes manifests: agent DaemonSet, checkpoint Job template, restore init container",
		Long: `Print, as one YAML stream, what runs vmsnap in a cluster:

  agent    Namespace, ServiceAccount and the node agent's DaemonSet (apply it)
  job      the checkpoint Job template a controller fills in (${PLACEHOLDERS})
  restore  the restore init container, shown in a PodTemplate with the QEMU
           container that loads the staged state

Every host path and privilege carries a comment saying why it is needed.
Workloads run with read-only root filesystems, no privilege escalation,
seccomp RuntimeDefault and dropped capabilities; the Job and the init
container run as non-root. Registry credentials come from a mounted
kubernetes.io/dockerconfigjson secret (--pull-secret).`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			var ps []manifests.Part
			for _, p := range parts {
				switch manifests.Part(p) {
				case manifests.PartAgent, manifests.PartJob, manifests.PartRestore:
					ps = append(ps, manifests.Part(p))
				default:
					return errcode.New(errcode.Usage, "--part %q: use agent, job or restore", p)
				}
			}
			if len(ps) == 0 {
				ps = manifests.Parts
			}
			b, err := manifests.RenderParts(o, ps...)
			if err != nil {
				return errcode.Ensure(errcode.Usage, err, "rendering the manifests")
			}
			_, err = out.stdout.Write(b)
			return coded(err)
		},
	}
	c.Flags().StringArrayVar(&parts, "part", nil, "only these parts: agent, job, restore (repeatable; default all)")
	c.Flags().StringVar(&o.Image, "image", "", "the vmsnap container image (pin it by digest)")
	c.Flags().StringVar(&o.Namespace, "namespace", "", "namespace of the agent and the Jobs (default vmsnap-system)")
	c.Flags().BoolVar(&o.OmitNamespace, "omit-namespace", false, "leave out the Namespace object")
	c.Flags().Int64Var(&o.SocketGroup, "socket-group", 0, "GID owning the agent's socket; Jobs get it as a supplementary group (default 2375)")
	c.Flags().StringVar(&o.KVMNodeLabel, "kvm-node-label", "", "node label selecting KVM nodes (default vmsnap.dev/kvm)")
	c.Flags().StringVar(&o.PullSecret, "pull-secret", "", "dockerconfigjson Secret with the registry credentials (default vmsnap-registry)")
	c.Flags().Int64Var(&o.RestoreUser, "restore-user", 0, "UID of the restore init container: make it QEMU's (default 65532)")
	c.Flags().Int64Var(&o.RestoreGroup, "restore-group", 0, "GID of the restore init container (default 65532)")
	return c
}
