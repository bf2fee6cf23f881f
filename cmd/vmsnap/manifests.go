package main

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/manifests"
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
  restore  a restored pod (a template): the restore init container and QEMU
           started by vmsnap launch, which loads the snapshot once per pod

Every host path and privilege carries a comment saying why it is needed, and
each template lists its ${PLACEHOLDERS} and their meaning at its top.

Node paths differ between distributions; the defaults are kubeadm's:
  k3s:      --containerd-socket /run/k3s/containerd/containerd.sock \
            --containerd-root /var/lib/rancher/k3s/agent/containerd
  microk8s: --containerd-socket /var/snap/microk8s/common/run/containerd.sock \
            --containerd-root /var/snap/microk8s/common/var/lib/containerd \
            --kubelet-pods-dir /var/snap/microk8s/common/var/lib/kubelet/pods
  a kubelet with --root-dir DIR: --kubelet-pods-dir DIR/pods

A registry with a private CA: kubectl create configmap NAME --from-file=ca.pem
in the agent's namespace and in each restored pod's, then --registry-ca-configmap NAME.
Workloads run with read-only root filesystems, no privilege escalation,
seccomp RuntimeDefault and dropped capabilities; the Job and the init
container run as non-root. Registry credentials come from a mounted
kubernetes.io/dockerconfigjson secret (--pull-secret).

Memory-file snapshots (a VM whose RAM is a shared memory-backend-file, for
instant resume): --part restore --memory-file adds, after the restore init
container (which then stages only the device state), a vmsnap-prepare init
container that materializes the snapshot's RAM file into the pod's own
emptyDir with medium: Memory (--ram-size-limit, at least the guest's memory;
it counts against the pod's memory) and records the QEMU arguments that map
it private in the state directory. vmsnap launch starts QEMU with them and
-incoming defer and loads the device state over the pod's QMP socket.
Each restored pod fetches and holds its own copy: RAM files are never
shared between pods, because QEMU before 8.2 opens a share=off file
read-write and a tenant's QEMU could otherwise change another's memory.
Sharing one prepared file between clones on a node (the agent's per-namespace
cache, vmsnap prepare --agent) would need a hostPath into a tenant's pod,
which the restricted Pod Security Standard forbids; it is not rendered.
Not with --restore-via-agent.`,
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
	c.Flags().StringVar(&o.ContainerdSocket, "containerd-socket", "", "the node's containerd socket (default "+manifests.DefaultContainerdSocket+")")
	c.Flags().StringVar(&o.ContainerdRoot, "containerd-root", "", "containerd's root directory on the node (default "+manifests.DefaultContainerdRoot+")")
	c.Flags().StringVar(&o.KubeletPodsDir, "kubelet-pods-dir", "", "the kubelet's pods directory, ROOT_DIR/pods (default "+manifests.DefaultKubeletPodsDir+")")
	c.Flags().StringVar(&o.RegistryCAConfigMap, "registry-ca-configmap", "", "ConfigMap whose ca.pem is the registry's CA, for the agent and the restore (--ca-file)")
	c.Flags().StringVar(&o.AgentRecipientSecret, "agent-recipient-secret", "", "Secret (in the agent's namespace) whose recipient.pem is the public key the agent encrypts every checkpoint for (--encrypt-recipient)")
	c.Flags().StringVar(&o.AgentDecryptionKeySecret, "agent-decryption-key-secret", "", "Secret (in the agent's namespace) whose keys are the node's private keys, which the agent decrypts admin callers' restores with, mounted 0440 root:root in the agent only (--decryption-key-dir)")
	c.Flags().Var(namespaceKeysFlag{&o.NamespaceKeySecrets}, "namespace-key-secret", "`NAMESPACE=SECRET`: a Secret (in the agent's namespace) whose key.pem is a private key of NAMESPACE; "+
		"the agent decrypts that namespace's restores with its keys alone and encrypts its checkpoints for them (repeatable)")
	c.Flags().StringVar(&o.DecryptionKeySecret, "decryption-key-secret", "", "Secret whose key.pem is the private key that decrypts encrypted snapshots, mounted 0440 in the restore init container only (--decryption-key; docs/encryption-and-signing.md)")
	c.Flags().StringArrayVar(&o.AllowRepositories, "allow-repository", nil, "agent: a registry target HOST[:PORT]/PREFIX it may use (repeatable; with none, every registry target is refused)")
	c.Flags().StringArrayVar(&o.AdminNamespaces, "admin-namespace", nil, "agent: a namespace whose callers may act on any VM, besides --namespace (repeatable)")
	c.Flags().StringVar(&o.LayoutRoot, "layout-root", "", "agent: host directory under which oci: layouts are allowed over the API (default: none)")
	c.Flags().DurationVar(&o.OperationTimeout, "operation-timeout", 0, "agent: bound on each operation (default: the agent's)")
	c.Flags().IntVar(&o.MaxWorkers, "max-workers", 0, "agent: cap on a request's workers (default: the agent's)")
	c.Flags().Int64Var(&o.RAMCacheMaxBytes, "ram-cache-max-bytes", 0, "agent: bound of each namespace's RAM file cache, in bytes (prepare requests; default: none)")
	c.Flags().StringVar(&o.OnRestart, "on-restart", "", "restore: when the restored QEMU container restarts, cold (boot from its disk; default) or fail")
	c.Flags().BoolVar(&o.RestoreViaAgent, "restore-via-agent", false, "restore: the init container restores the disk alone and QEMU waits (-incoming defer) for the agent to load the state")
	c.Flags().BoolVar(&o.MemoryFile, "memory-file", false, "restore: the snapshot is in the memory-file format: an init container prepares its RAM file into the pod's own emptyDir (medium: Memory) and launch maps it")
	c.Flags().Var(quantityFlag{&o.RestoreRAMSizeLimit}, "ram-size-limit", "restore, with --memory-file: size limit of the RAM volume, at least the guest's memory (default "+manifests.DefaultRestoreRAMLimit+")")
	c.Flags().StringVar(&o.BaseDir, "base-dir", "", "restore: the QEMU image's directory holding the overlay's backing file (default "+manifests.DefaultBaseDir+")")
	return c
}

// namespaceKeysFlag is a repeatable NAMESPACE=SECRET.
type namespaceKeysFlag struct {
	v *[]manifests.NamespaceKeySecret
}

func (f namespaceKeysFlag) String() string {
	if f.v == nil {
		return ""
	}
	var s []string
	for _, n := range *f.v {
		s = append(s, n.String())
	}
	return strings.Join(s, ",")
}

func (f namespaceKeysFlag) Set(s string) error {
	n, err := manifests.ParseNamespaceKeySecret(s)
	if err == nil {
		*f.v = append(*f.v, n)
	}
	return err
}

func (namespaceKeysFlag) Type() string { return "stringArray" }

// quantityFlag is a Kubernetes quantity (8Gi, 512Mi) as a flag.
type quantityFlag struct{ q *resource.Quantity }

func (f quantityFlag) String() string {
	if f.q == nil || f.q.IsZero() {
		return ""
	}
	return f.q.String()
}

func (f quantityFlag) Set(s string) error {
	q, err := resource.ParseQuantity(s)
	if err != nil {
		return fmt.Errorf("%q is not a quantity such as 8Gi: %v", s, err)
	}
	*f.q = q
	return nil
}

func (quantityFlag) Type() string { return "quantity" }
