package manifests

import "fmt"

// daemonSetDoc is the agent's DaemonSet with the comments that explain each
// host path and privilege: a header block, and notes beside the fields.
func daemonSetDoc(o Options) document {
	return document{header: daemonSetHeader(o), obj: DaemonSet(o), notes: daemonSetNotes(o)}
}

// daemonSetHeader is the header block: what each host path and privilege is
// for, and what the agent does without.
func daemonSetHeader(o Options) []string {
	caps := string(AgentCapability)
	for _, c := range o.AgentExtraCapabilities {
		caps += ", " + string(c)
	}
	h := []string{
		"vmsnap node agent: one per KVM node, serving its API on " + AgentSocket(o) + ".",
		"",
		"Host paths, each mounted at the same path as on the node (containerd reports host paths):",
		"  " + o.ContainerdSocket + " (Socket)",
		"    The node's containerd: find a pod's QEMU container by pod UID and container name, read",
		"    its mounts, hear when it is deleted. Whoever can use this socket is root on the node:",
		"    the price of finding VMs without ptrace or access to the Kubernetes API.",
		"  " + o.ContainerdRoot + " (Directory, read-only)",
		"    containerd's root: a disk overlay in a QEMU container's writable layer is read in the",
		"    snapshot directory that holds that layer. Nothing is written there.",
		"  " + o.KubeletPodsDir + " (Directory, read-only, HostToContainer)",
		"    The pods' volumes, where the VMs' QMP sockets and disk overlays are. The agent connects",
		"    to the sockets and reads the overlays; it writes nothing there (the restore init",
		"    container puts overlays in place). Mounts the kubelet adds below it later show up",
		"    as the kubelet made them, not read-only.",
		"  " + o.SocketDir + " (DirectoryOrCreate)",
		fmt.Sprintf("    The agent's API socket, mode 0660, group %d. The checkpoint Jobs mount it.", o.SocketGroup),
		"  " + o.StateDir + " (DirectoryOrCreate)",
		"    The journal and staging, kept across restarts so that a restarted agent continues",
		"    any VM an interrupted checkpoint had stopped.",
		"",
		"Privileges:",
		"  runAsUser 0 with every capability dropped but " + caps + ": the VMs' sockets and",
		"    files belong to their pods' users, and connect() on a unix socket needs write",
		"    permission on it. Without DAC_OVERRIDE, root is refused both, like any user.",
		"  hostPID: the agent identifies each caller by the pid its socket reports (SO_PEERCRED),",
		"    which it maps to the caller's container, and so namespace, through containerd: pids",
		"    of the node. It does not enter or trace any process.",
		"  Not privileged, no privilege escalation, read-only root filesystem, seccomp",
		"    RuntimeDefault, no host network or IPC namespace, no service account token.",
		"  Not needed: SYS_ADMIN (the kubelet does the mounts), SYS_PTRACE (QEMU is reached over",
		"    QMP, not by entering its namespaces), CHOWN and FOWNER (the agent changes no one",
		"    else's files), DAC_READ_SEARCH (DAC_OVERRIDE covers it), SETUID, SETGID, KILL,",
		"    NET_RAW, NET_BIND_SERVICE, MKNOD.",
		"",
		"Registry credentials: Secret " + o.PullSecret + " (kubernetes.io/dockerconfigjson), its",
		"  .dockerconfigjson mounted read-only as " + RegistryConfigDir + "/config.json; DOCKER_CONFIG",
		"  points there. The agent pushes snapshots with them.",
		"Policy (vmsnap agent --help): --allow-repository HOST[:PORT]/PREFIX names each registry",
		"  target the agent may use; with none, every registry target is refused. A PREFIX component",
		"  {namespace} is the caller's pod namespace: HOST/vms/{namespace} gives each tenant its own",
		"  repositories (admins match any namespace); plain prefixes are shared. --admin-namespace",
		"  " + o.Namespace + " lets the checkpoint Jobs act on any VM; callers elsewhere act on their own",
		"  namespace's VMs only.",
		"Probes exec `vmsnap agent health --socket PATH`, which asks the agent's /healthz over the",
		"  socket and fails unless it answers: an HTTP probe cannot reach a unix socket.",
	}
	if len(o.AllowRepositories) == 0 {
		h = append(h, "Note: no --allow-repository given, so this agent refuses every registry target: add one",
			"  per registry prefix (vmsnap manifests --allow-repository HOST[:PORT]/PREFIX).")
	}
	return h
}

// daemonSetNotes are the comments beside the fields, those of the options
// given last.
func daemonSetNotes(o Options) []note {
	notes := []note{
		{"nodeSelector:", fmt.Sprintf("Only KVM nodes run VMs: label them %s=%s.", o.KVMNodeLabel, o.KVMNodeLabelValue)},
		{"path: " + o.ContainerdSocket, "containerd: resolve pod UID + container name to the container and its mounts; watch deletions."},
		{"path: " + o.ContainerdRoot, "containerd's snapshots: disk overlays in a container's writable layer, read only."},
		{"path: " + o.KubeletPodsDir, "Pods' volumes: QMP sockets to connect to, disk overlays to read. Mounted read-only."},
		{"mountPropagation: HostToContainer", "Volumes mounted after the agent started (memory-backed emptyDirs, CSI) must appear in it too."},
		{"path: " + o.SocketDir, fmt.Sprintf("The agent's API socket (0660, group %d); the checkpoint Jobs mount this directory.", o.SocketGroup)},
		{"path: " + o.StateDir, "Journal and staging: survive restarts, so a restarted agent continues the VMs it had stopped."},
		{"runAsUser: 0", "Root, to reach QMP sockets and overlays owned by other pods' users, with DAC_OVERRIDE alone."},
		{fmt.Sprintf("runAsGroup: %d", o.SocketGroup), "Its primary group owns the API socket, so the Jobs (in this group) may connect."},
		{"- " + string(AgentCapability), "The one capability kept: root's only way past the VM user's permissions (connect, read)."},
		{"- ALL", "Every other capability is dropped."},
		{"privileged: false", "Not privileged: no devices, no host kernel access beyond the mounts above."},
		{"allowPrivilegeEscalation: false", "no_new_privs: nothing it runs can gain capabilities."},
		{"readOnlyRootFilesystem: true", "It writes only to its state and socket directories."},
		{"secretName: " + o.PullSecret, "Registry credentials (.dockerconfigjson -> config.json), read-only; DOCKER_CONFIG points here."},
		{"defaultMode: 256", "0400: root's only."},
		{"livenessProbe:", "exec, since an HTTP probe cannot reach a unix socket: `vmsnap agent health` asks /healthz."},
		{"hostPID: true", "Callers are identified by their pid (SO_PEERCRED) -> container -> namespace, via containerd: host pids."},
		{"- " + o.Namespace, "--admin-namespace: callers here act on any VM; " + o.Namespace + " runs the checkpoint Jobs."},
	}
	if len(o.AllowRepositories) > 0 {
		notes = append(notes, note{"- " + o.AllowRepositories[0], "--allow-repository: the only registry targets the agent uses; with none, all are refused. " +
			"{namespace} in one (HOST/vms/{namespace}) is the caller's namespace: each tenant its own repositories."})
	}
	if o.LayoutRoot != "" {
		notes = append(notes, note{"path: " + o.LayoutRoot, "oci: layouts over the API only below this directory (--layout-root), a tenant's below its NAMESPACE; only the agent may write there."})
	}
	if o.RegistryCAConfigMap != "" {
		notes = append(notes, note{"- configMap:", "The registry's private CA (ca.pem) from ConfigMap " + o.RegistryCAConfigMap + ", passed as --ca-file."})
	}
	if o.AgentRecipientSecret != "" {
		notes = append(notes, note{"secretName: " + o.AgentRecipientSecret, "The public key every checkpoint is encrypted for (recipient.pem, --encrypt-recipient)."})
	}
	if o.AgentDecryptionKeySecret != "" {
		notes = append(notes, note{"name: " + o.AgentDecryptionKeySecret, "The node's private keys (--decryption-key-dir's top): only admin callers' restores decrypt with them; 0440 root:root."})
	}
	for _, n := range o.NamespaceKeySecrets {
		notes = append(notes, note{"name: " + n.Secret, "Namespace " + n.Namespace + "'s private key (key.pem): its restores decrypt, and its checkpoints are encrypted, with it alone."})
	}
	for _, c := range o.AgentExtraCapabilities {
		notes = append(notes, note{"- " + string(c), "Added by the operator (AgentExtraCapabilities)."})
	}
	return notes
}
