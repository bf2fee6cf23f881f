package manifests

import (
	"slices"
	"strconv"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Label keys and component names on every object.
const (
	LabelName      = "app.kubernetes.io/name"
	LabelComponent = "app.kubernetes.io/component"
	// LabelSourcePodUID is set on checkpoint Jobs: the UID of the pod whose
	// VM they checkpoint, so that a controller finds its Jobs by UID.
	LabelSourcePodUID = "vmsnap.dev/source-pod-uid"

	ComponentAgent      = "agent"
	ComponentCheckpoint = "checkpoint"
	ComponentRestore    = "restore"
)

// Volume names used by the agent and the Job.
const (
	volContainerd = "containerd-socket"
	volCtrdRoot   = "containerd-root"
	volPods       = "kubelet-pods"
	volSocket     = "agent-socket"
	volState      = "agent-state"
	// VolumeRegistry is the volume of the registry credentials secret, in
	// the agent and in the restored pod.
	VolumeRegistry = "vmsnap-registry-config"
	// VolumeRegistryCA is the volume of RegistryCAConfigMap, in the agent
	// and in the restored pod.
	VolumeRegistryCA = "vmsnap-registry-ca"
	volLayoutRoot    = "layout-root"
	// The agent's encryption Secrets (AgentRecipientSecret,
	// AgentDecryptionKeySecret).
	volRecipient      = "vmsnap-encrypt-recipient"
	volDecryptionKeys = "vmsnap-decryption-keys"
	// VolumeDecryptionKey is the volume of DecryptionKeySecret, in the
	// restored pod's init container.
	VolumeDecryptionKey = "vmsnap-decryption-key"
)

// AgentCapability is the only capability the agent keeps. Root without it
// is an ordinary user to file permission checks, so it could neither
// connect() to a QMP socket owned by the VM's user (connecting needs write
// permission on the socket) nor read that user's disk overlay, nor search
// the VM's directories in the pod's volume. docs/kubernetes.md ("The agent's
// privileges") says what the agent does not need.
const AgentCapability corev1.Capability = "DAC_OVERRIDE"

func labels(o Options, component string) map[string]string {
	return map[string]string{LabelName: o.Name, LabelComponent: component}
}

func ptr[T any](v T) *T { return &v }

// securityContext is the container hardening shared by every vmsnap
// container: a read-only root, no privilege escalation, the runtime's
// seccomp profile, every capability dropped but add.
func securityContext(uid, gid int64, add ...corev1.Capability) *corev1.SecurityContext {
	return &corev1.SecurityContext{
		RunAsUser:                ptr(uid),
		RunAsGroup:               ptr(gid),
		RunAsNonRoot:             ptr(uid != 0),
		Privileged:               ptr(false),
		AllowPrivilegeEscalation: ptr(false),
		ReadOnlyRootFilesystem:   ptr(true),
		Capabilities: &corev1.Capabilities{
			Drop: []corev1.Capability{"ALL"},
			Add:  add,
		},
		SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
	}
}

func podSecurityContext(supplementalGroups ...int64) *corev1.PodSecurityContext {
	return &corev1.PodSecurityContext{
		SupplementalGroups: supplementalGroups,
		SeccompProfile:     &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
	}
}

func pullSecrets(o Options) []corev1.LocalObjectReference {
	var refs []corev1.LocalObjectReference
	for _, s := range o.ImagePullSecrets {
		refs = append(refs, corev1.LocalObjectReference{Name: s})
	}
	return refs
}

func hostPathVolume(name, p string, t corev1.HostPathType) corev1.Volume {
	return corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{
		HostPath: &corev1.HostPathVolumeSource{Path: p, Type: ptr(t)},
	}}
}

// registryVolume mounts the dockerconfigjson secret's one key as
// config.json, the layout DOCKER_CONFIG expects. mode is the files' mode.
func registryVolume(o Options, mode int32) corev1.Volume {
	return corev1.Volume{Name: VolumeRegistry, VolumeSource: corev1.VolumeSource{
		Secret: &corev1.SecretVolumeSource{
			SecretName:  o.PullSecret,
			Items:       []corev1.KeyToPath{{Key: corev1.DockerConfigJsonKey, Path: "config.json"}},
			DefaultMode: ptr(mode),
		},
	}}
}

func registryMount() corev1.VolumeMount {
	return corev1.VolumeMount{Name: VolumeRegistry, MountPath: RegistryConfigDir, ReadOnly: true}
}

// registryCAVolume mounts RegistryCAConfigMap's ca.pem, readable by any
// user (the default mode, 0644): a CA certificate is public.
func registryCAVolume(o Options) corev1.Volume {
	return corev1.Volume{Name: VolumeRegistryCA, VolumeSource: corev1.VolumeSource{
		ConfigMap: &corev1.ConfigMapVolumeSource{
			LocalObjectReference: corev1.LocalObjectReference{Name: o.RegistryCAConfigMap},
			Items:                []corev1.KeyToPath{{Key: RegistryCAKey, Path: RegistryCAKey}},
		},
	}}
}

// decryptionKeyVolume mounts DecryptionKeySecret's key.pem with mode 0440:
// readable by root and by the pod's fsGroup, which Kubernetes adds to
// every container's groups, never by others (vmsnap refuses a key file
// others may read).
func decryptionKeyVolume(o Options) corev1.Volume {
	return corev1.Volume{Name: VolumeDecryptionKey, VolumeSource: corev1.VolumeSource{
		Secret: &corev1.SecretVolumeSource{
			SecretName:  o.DecryptionKeySecret,
			Items:       []corev1.KeyToPath{{Key: DecryptionKeyName, Path: DecryptionKeyName}},
			DefaultMode: ptr(int32(0o440)),
		},
	}}
}

func registryCAMount() corev1.VolumeMount {
	return corev1.VolumeMount{Name: VolumeRegistryCA, MountPath: RegistryCADir, ReadOnly: true}
}

func registryEnv() corev1.EnvVar {
	return corev1.EnvVar{Name: "DOCKER_CONFIG", Value: RegistryConfigDir}
}

// AgentSocket is the agent's API socket, the same path on the host, in the
// agent and in the Jobs.
func AgentSocket(o Options) string { return o.withDefaults().SocketDir + "/" + SocketName }

// Namespace is the agent's namespace, where the checkpoint Jobs run too.
// Its Pod Security level is privileged, enforced, warned and audited alike:
// the agent needs hostPath volumes and the host PID namespace and every Job
// mounts the agent's socket directory, all outside baseline, so a baseline
// warning would fire on every Job and say nothing. Tenants' namespaces stay
// restricted: the restored pod's containers meet it.
func Namespace(o Options) *corev1.Namespace {
	o = o.withDefaults()
	return &corev1.Namespace{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Namespace"},
		ObjectMeta: metav1.ObjectMeta{
			Name: o.Namespace,
			Labels: map[string]string{
				LabelName:                                    o.Name,
				"pod-security.kubernetes.io/enforce":         "privileged",
				"pod-security.kubernetes.io/warn":            "privileged",
				"pod-security.kubernetes.io/audit":           "privileged",
				"pod-security.kubernetes.io/enforce-version": "latest",
			},
		},
	}
}

// ServiceAccount is the identity of the agent and the Jobs. Neither talks to
// the Kubernetes API (the agent asks containerd; the Job asks the agent),
// so it has no role and its token is not mounted.
func ServiceAccount(o Options) *corev1.ServiceAccount {
	o = o.withDefaults()
	return &corev1.ServiceAccount{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "ServiceAccount"},
		ObjectMeta: metav1.ObjectMeta{
			Name: o.Name, Namespace: o.Namespace,
			Labels: map[string]string{LabelName: o.Name},
		},
		AutomountServiceAccountToken: ptr(false),
	}
}

// AgentHealthCommand is the agent's probe: an HTTP probe cannot reach a
// unix socket, so the probe execs the vmsnap client, which asks the agent's
// /healthz over the socket and exits non-zero unless it answers.
func AgentHealthCommand(o Options) []string {
	return []string{"vmsnap", "agent", "health", "--socket", AgentSocket(o)}
}

// DaemonSet is the node agent on every node labelled KVMNodeLabel.
func DaemonSet(o Options) *appsv1.DaemonSet {
	o = o.withDefaults()
	probe := func(period, failures int32) *corev1.Probe {
		return &corev1.Probe{
			ProbeHandler:     corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: AgentHealthCommand(o)}},
			PeriodSeconds:    period,
			TimeoutSeconds:   5,
			FailureThreshold: failures,
		}
	}
	caps := append([]corev1.Capability{AgentCapability}, o.AgentExtraCapabilities...)
	container := corev1.Container{
		Name:            "agent",
		Image:           o.Image,
		ImagePullPolicy: o.ImagePullPolicy,
		Command:         AgentArgs(o),
		Env:             []corev1.EnvVar{registryEnv()},
		Resources:       o.AgentResources,
		VolumeMounts:    agentMounts(o),
		// The agent recovers its journal before it listens: give it time
		// to start before liveness counts.
		StartupProbe:             probe(5, 60),
		LivenessProbe:            probe(20, 3),
		ReadinessProbe:           probe(10, 2),
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
		// Root, but with one capability: see AgentCapability.
		SecurityContext: securityContext(0, o.SocketGroup, caps...),
	}
	sel := labels(o, ComponentAgent)
	return &appsv1.DaemonSet{
		TypeMeta: metav1.TypeMeta{APIVersion: "apps/v1", Kind: "DaemonSet"},
		ObjectMeta: metav1.ObjectMeta{
			Name: o.Name + "-agent", Namespace: o.Namespace, Labels: labels(o, ComponentAgent),
		},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: sel},
			UpdateStrategy: appsv1.DaemonSetUpdateStrategy{
				Type: appsv1.RollingUpdateDaemonSetStrategyType,
			},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels(o, ComponentAgent)},
				Spec: corev1.PodSpec{
					NodeSelector:                 map[string]string{o.KVMNodeLabel: o.KVMNodeLabelValue},
					Tolerations:                  o.Tolerations,
					ServiceAccountName:           o.Name,
					AutomountServiceAccountToken: ptr(false),
					EnableServiceLinks:           ptr(false),
					// The agent identifies a caller by the pid its socket
					// reports (SO_PEERCRED), mapped to its container through
					// containerd: pids of the node's PID namespace.
					HostPID:          true,
					ImagePullSecrets: pullSecrets(o),
					// On SIGTERM the agent cancels its operations, each of
					// which continues the VM it had stopped.
					TerminationGracePeriodSeconds: ptr(int64(60)),
					SecurityContext:               podSecurityContext(),
					Containers:                    []corev1.Container{container},
					Volumes:                       agentVolumes(o),
				},
			},
		},
	}
}

// AgentArgs is the agent's command line, its policy flags included.
func AgentArgs(o Options) []string {
	o = o.withDefaults()
	args := []string{"vmsnap", "agent", "--socket", AgentSocket(o), "--state-dir", o.StateDir,
		"--containerd-address", o.ContainerdSocket}
	for _, r := range o.AllowRepositories {
		args = append(args, "--allow-repository", r)
	}
	for _, n := range AdminNamespaces(o) {
		args = append(args, "--admin-namespace", n)
	}
	if o.LayoutRoot != "" {
		args = append(args, "--layout-root", o.LayoutRoot)
	}
	if o.KubeletPodsDir != DefaultKubeletPodsDir {
		// Mounted at the same path: the agent opens VMs' files only below it.
		args = append(args, "--kubelet-pods-dir", o.KubeletPodsDir)
	}
	if o.OperationTimeout > 0 {
		args = append(args, "--operation-timeout", o.OperationTimeout.String())
	}
	if o.MaxWorkers > 0 {
		args = append(args, "--max-workers", strconv.Itoa(o.MaxWorkers))
	}
	if o.RAMCacheMaxBytes > 0 {
		args = append(args, "--ram-cache-max-bytes", strconv.FormatInt(o.RAMCacheMaxBytes, 10))
	}
	if o.RegistryCAConfigMap != "" {
		args = append(args, "--ca-file", RegistryCADir+"/"+RegistryCAKey)
	}
	if o.AgentRecipientSecret != "" {
		args = append(args, "--encrypt-recipient", "jwe:"+AgentRecipientDir+"/"+AgentRecipientName)
	}
	if agentHasKeys(o) {
		args = append(args, "--decryption-key-dir", AgentDecryptionKeyDir)
	}
	return args
}

// AdminNamespaces are the agent's --admin-namespace values: Namespace
// first, because the checkpoint Jobs run there and act on tenants' VMs,
// then AdminNamespaces.
func AdminNamespaces(o Options) []string {
	o = o.withDefaults()
	ns := []string{o.Namespace}
	for _, n := range o.AdminNamespaces {
		if !slices.Contains(ns, n) {
			ns = append(ns, n)
		}
	}
	return ns
}

func agentMounts(o Options) []corev1.VolumeMount {
	m := []corev1.VolumeMount{
		{Name: volContainerd, MountPath: o.ContainerdSocket},
		// Plain directories (a layer's upperdir): no propagation needed.
		{Name: volCtrdRoot, MountPath: o.ContainerdRoot, ReadOnly: true},
		{Name: volPods, MountPath: o.KubeletPodsDir, ReadOnly: true,
			MountPropagation: ptr(corev1.MountPropagationHostToContainer)},
		{Name: volSocket, MountPath: o.SocketDir},
		{Name: volState, MountPath: o.StateDir},
		registryMount(),
	}
	if o.LayoutRoot != "" {
		m = append(m, corev1.VolumeMount{Name: volLayoutRoot, MountPath: o.LayoutRoot})
	}
	if o.RegistryCAConfigMap != "" {
		m = append(m, registryCAMount())
	}
	if o.AgentRecipientSecret != "" {
		m = append(m, corev1.VolumeMount{Name: volRecipient, MountPath: AgentRecipientDir, ReadOnly: true})
	}
	if agentHasKeys(o) {
		m = append(m, corev1.VolumeMount{Name: volDecryptionKeys, MountPath: AgentDecryptionKeyDir, ReadOnly: true})
	}
	return m
}

func agentVolumes(o Options) []corev1.Volume {
	v := []corev1.Volume{
		hostPathVolume(volContainerd, o.ContainerdSocket, corev1.HostPathSocket),
		hostPathVolume(volCtrdRoot, o.ContainerdRoot, corev1.HostPathDirectory),
		hostPathVolume(volPods, o.KubeletPodsDir, corev1.HostPathDirectory),
		hostPathVolume(volSocket, o.SocketDir, corev1.HostPathDirectoryOrCreate),
		hostPathVolume(volState, o.StateDir, corev1.HostPathDirectoryOrCreate),
		registryVolume(o, 0o400),
	}
	if o.LayoutRoot != "" {
		v = append(v, hostPathVolume(volLayoutRoot, o.LayoutRoot, corev1.HostPathDirectoryOrCreate))
	}
	if o.RegistryCAConfigMap != "" {
		v = append(v, registryCAVolume(o))
	}
	if o.AgentRecipientSecret != "" {
		v = append(v, corev1.Volume{Name: volRecipient, VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
			SecretName: o.AgentRecipientSecret, Items: []corev1.KeyToPath{{Key: AgentRecipientName, Path: AgentRecipientName}}, DefaultMode: ptr(int32(0o444)),
		}}})
	}
	if agentHasKeys(o) {
		v = append(v, agentKeysVolume(o))
	}
	return v
}
