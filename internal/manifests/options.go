// Package manifests builds the Kubernetes objects that run vmsnap in a
// cluster, from the k8s.io/api types, and renders them as commented YAML:
//
//   - the node agent, a DaemonSet on KVM nodes (with its Namespace and
//     ServiceAccount): DaemonSet;
//   - the checkpoint Job a controller creates on the source pod's node:
//     CheckpointJob, or JobTemplate with placeholders;
//   - the restore init container added to the restored pod, with the volumes
//     it needs: RestoreInit, RestoreInitContainer, AddRestore.
//
// Render writes them all as one multi-document YAML stream (RenderParts for
// a selection). Every host path and every privilege is explained by a
// comment in that output, next to the field where that can be done without
// ambiguity and in a header block per object in any case.
//
// Options' zero value gives working defaults; see the Default* constants.
//
// Options.Validate (called by Render, not by the constructors) refuses
// unsafe or broken manifests. Every host path and privilege carries a
// comment naming its line, and rendering fails if a note matches no line or
// several. Not for applying objects to a cluster or watching them: it is no
// controller.
package manifests

import (
	"path"
	"regexp"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// Defaults for the zero value of each Options field.
const (
	DefaultImage            = "ghcr.io/vmsnap/vmsnap:latest"
	DefaultNamespace        = "vmsnap-system"
	DefaultName             = "vmsnap"
	DefaultSocketGroup      = 2375
	DefaultKVMNodeLabel     = "vmsnap.dev/kvm"
	DefaultKVMNodeValue     = "true"
	DefaultPullSecret       = "vmsnap-registry"
	DefaultSocketDir        = "/run/vmsnap"
	DefaultStateDir         = "/var/lib/vmsnap"
	DefaultContainerdSocket = "/run/containerd/containerd.sock"
	DefaultContainerdRoot   = "/var/lib/containerd"
	DefaultKubeletPodsDir   = "/var/lib/kubelet/pods"

	// DefaultNonRootUser is the UID (and GID) of the checkpoint Job and the
	// restore init container: the conventional "nonroot" user of distroless
	// images, which owns nothing on the node.
	DefaultNonRootUser = 65532

	DefaultCheckpointMode           = "pause"
	DefaultJobActiveDeadlineSeconds = 1800
	DefaultJobTTLSecondsAfterFinish = 3600

	DefaultRestoreStateDir    = "/vm/state"
	DefaultRestoreDiskPath    = "/vm/disk/overlay.qcow2"
	DefaultRestoreStateVolume = "vmsnap-state"
	DefaultRestoreDiskVolume  = "vm-disk"
	DefaultRestoreStateLimit  = "8Gi"
	// DefaultRestoreMarkerDir holds the restored pod's markers: the init
	// container's (restore --marker-dir) and the launcher's (launch
	// --marker-dir), on an emptyDir of the pod.
	DefaultRestoreMarkerDir    = "/vm/markers"
	DefaultRestoreMarkerVolume = "vmsnap-markers"
	// DefaultRestoreRAMDir holds a memory-file snapshot's RAM file in the
	// restored pod (MemoryFile), on DefaultRestoreRAMVolume, an emptyDir
	// with medium: Memory.
	DefaultRestoreRAMDir    = "/vm/ram"
	DefaultRestoreRAMVolume = "vm-ram"
	DefaultRestoreRAMLimit  = "8Gi"
	// DefaultRestoreRunVolume is the emptyDir holding QMPSocket's directory.
	DefaultRestoreRunVolume = "vm-run"
	// DefaultBaseDir is where the QEMU image holds the overlay's backing
	// file, which an init container copies beside the restored overlay.
	DefaultBaseDir = "/vm/base"
	// DefaultOnRestart: a restarted QEMU container boots cold from its disk.
	DefaultOnRestart = "cold"

	// SocketName is the agent's API socket inside SocketDir.
	SocketName = "agent.sock"
	// DefaultQMPSocket is where the examples put the QEMU container's
	// monitor socket.
	DefaultQMPSocket = "/vm/run/qmp.sock"
	// RegistryCADir is where the RegistryCAConfigMap is mounted; its key
	// RegistryCAKey is passed as --ca-file.
	RegistryCADir = "/etc/vmsnap/ca"
	RegistryCAKey = "ca.pem"
	// RegistryConfigDir is where the registry credentials secret is mounted
	// (DOCKER_CONFIG): it holds config.json, the secret's .dockerconfigjson.
	RegistryConfigDir = "/etc/vmsnap/registry"
	// DecryptionKeyDir is where DecryptionKeySecret is mounted in the restore
	// init container; its key DecryptionKeyName is passed as
	// --decryption-key.
	DecryptionKeyDir  = "/etc/vmsnap/decryption"
	DecryptionKeyName = "key.pem"
	// AgentRecipientDir is where AgentRecipientSecret is mounted in the
	// agent; its key AgentRecipientName is passed as --encrypt-recipient.
	AgentRecipientDir  = "/etc/vmsnap/recipient"
	AgentRecipientName = "recipient.pem"
	// AgentDecryptionKeyDir is where AgentDecryptionKeySecret is mounted in
	// the agent, passed as --decryption-key-dir.
	AgentDecryptionKeyDir = "/etc/vmsnap/decryption-keys"
	// TerminationLog is where the checkpoint Job writes its result JSON.
	TerminationLog = "/dev/termination-log"
)

// Options configures the manifests. The zero value of every field means its
// default (the Default* constants).
type Options struct {
	// Image is the vmsnap image, used by the agent, the Job and the init
	// container. Pin it by digest in production.
	Image string
	// ImagePullPolicy of every vmsnap container (default IfNotPresent).
	ImagePullPolicy corev1.PullPolicy
	// ImagePullSecrets lets the kubelet pull Image itself from a private
	// registry (none by default). Not to be confused with PullSecret.
	ImagePullSecrets []string
	// Namespace of the agent, its ServiceAccount and the checkpoint Jobs.
	Namespace string
	// OmitNamespace leaves the Namespace object out of Render's output, for
	// a namespace that exists already.
	OmitNamespace bool
	// Name is the prefix of object names (default "vmsnap").
	Name string

	// SocketGroup is the GID that owns the agent's socket (mode 0660): the
	// agent runs with it as its primary group, and Jobs as a supplementary
	// group. Nothing else on the node should use this GID.
	SocketGroup int64
	// KVMNodeLabel and KVMNodeLabelValue select the nodes the agent runs on
	// (default vmsnap.dev/kvm=true).
	KVMNodeLabel      string
	KVMNodeLabelValue string
	// Tolerations for the agent and the Jobs, for KVM nodes that are tainted.
	Tolerations []corev1.Toleration

	// PullSecret names a Secret of type kubernetes.io/dockerconfigjson with
	// the credentials vmsnap uses to push and pull snapshots (default
	// "vmsnap-registry"). The agent reads it in Namespace; the restore init
	// container in the restored pod's namespace.
	PullSecret string
	// RegistryCAConfigMap names a ConfigMap whose key ca.pem holds the CA
	// certificate(s) of a registry with a private CA. It is mounted in the
	// agent (Namespace) and in the restore init container (the restored
	// pod's namespace: create it there too), passed as --ca-file. Empty:
	// the system's roots.
	RegistryCAConfigMap string
	// DecryptionKeySecret names a Secret whose key key.pem is the PEM
	// private key that decrypts encrypted snapshots (docs/encryption-and-signing.md).
	// It is mounted in the restore init container only, mode 0440 (group
	// read: the container is not root, so the restored pod needs an
	// fsGroup, which RestorePod sets), and passed as --decryption-key.
	// Empty: snapshots are not encrypted.
	DecryptionKeySecret string
	// AgentRecipientSecret names a Secret in Namespace whose key
	// recipient.pem is a PEM public key: the agent encrypts every
	// checkpoint for it (--encrypt-recipient). AgentDecryptionKeySecret
	// names a Secret in Namespace whose every key is a PEM private key of
	// the node's: the agent decrypts with them for admin callers only
	// (the files at the top of --decryption-key-dir). Empty: none.
	AgentRecipientSecret     string
	AgentDecryptionKeySecret string
	// NamespaceKeySecrets give each namespace its own keys in the agent:
	// Secrets in Namespace whose key.pem is a private key of that
	// namespace, mounted as --decryption-key-dir/NAMESPACE/SECRET.pem. The
	// agent decrypts that namespace's restores and prepares with them
	// (and no other caller's), and encrypts its checkpoints for them.
	// Mounted 0440 (root:root) in the agent only, with
	// AgentDecryptionKeySecret's keys in one projected volume.
	NamespaceKeySecrets []NamespaceKeySecret

	// The agent's policy (vmsnap agent flags), passed through:
	// AllowRepositories are the registry targets (HOST[:PORT]/PREFIX) the
	// agent may push to and pull from (--allow-repository); with none, every
	// registry target is refused. AdminNamespaces may act on any VM
	// (--admin-namespace); Namespace, where the checkpoint Jobs run, is
	// always one. LayoutRoot is the host directory under which oci: layouts
	// are allowed (--layout-root, mounted at the same path; empty: none).
	// OperationTimeout bounds each operation (--operation-timeout; zero:
	// the agent's default). MaxWorkers caps a request's workers
	// (--max-workers; zero: the agent's default). RAMCacheMaxBytes bounds
	// each namespace's RAM file cache, filled by prepare requests
	// (--ram-cache-max-bytes; zero: no bound).
	AllowRepositories []string
	AdminNamespaces   []string
	LayoutRoot        string
	OperationTimeout  time.Duration
	MaxWorkers        int
	RAMCacheMaxBytes  int64

	// Host paths of the agent, each mounted at the same path in its
	// container so that paths containerd reports are valid there as is.
	SocketDir        string // the agent's socket directory, shared with Jobs
	StateDir         string // the agent's journal and staging
	ContainerdSocket string // the node's containerd API socket
	ContainerdRoot   string // containerd's root: the snapshots holding writable layers
	KubeletPodsDir   string // where the kubelet keeps pods' volumes

	// AgentExtraCapabilities are added to the agent's one capability,
	// DAC_OVERRIDE. None are needed today; see docs/kubernetes.md.
	AgentExtraCapabilities []corev1.Capability

	// JobUser is the UID and GID of the checkpoint Job (default 65532).
	JobUser int64
	// CheckpointMode is the default --mode of checkpoint Jobs: pause,
	// snapshot or live (default pause: the source is about to go away).
	CheckpointMode string
	// JobActiveDeadlineSeconds bounds a checkpoint Job (default 1800).
	JobActiveDeadlineSeconds int64
	// JobTTLSecondsAfterFinished keeps a finished Job, and the result in
	// its pod's termination message, this long for the controller to read
	// (default 3600).
	JobTTLSecondsAfterFinished int32

	// RestoreUser and RestoreGroup run the restore init container (default
	// 65532). Make them the QEMU container's UID and GID, so that QEMU may
	// open the disk overlay and state the init container writes.
	RestoreUser  int64
	RestoreGroup int64
	// RestoreStateDir is where the init container stages the VM state, on
	// RestoreStateVolume (an emptyDir of at most RestoreStateSizeLimit).
	RestoreStateDir       string
	RestoreStateVolume    string
	RestoreStateSizeLimit resource.Quantity
	// QMPSocket is the QEMU container's monitor socket (QEMU's -qmp
	// unix:PATH,server=on,wait=off), for IncomingExec (default
	// DefaultQMPSocket).
	QMPSocket string
	// RestoreDiskPath is where the init container puts the disk overlay, on
	// RestoreDiskVolume: normally the QEMU container's own disk volume.
	RestoreDiskPath   string
	RestoreDiskVolume string
	// RestoreMarkerDir is the restored pod's marker directory, on
	// RestoreMarkerVolume, a disk-backed emptyDir: it lives as long as the
	// pod (container restarts and sandbox recreation included) and no
	// longer, which is what "one restore per pod" needs.
	RestoreMarkerDir    string
	RestoreMarkerVolume string
	// RestoreRunVolume is the emptyDir at QMPSocket's directory.
	RestoreRunVolume string
	// OnRestart is what the restored pod's QEMU does when its container
	// restarts after the snapshot was loaded: "cold" (boot from the disk as
	// it is now) or "fail" (vmsnap launch --on-restart).
	OnRestart string
	// RestoreViaAgent renders the restored pod for a restore through the
	// agent: the init container restores the disk alone, and QEMU starts
	// with vmsnap launch --defer (-incoming defer) for the agent to load
	// the state (vmsnap restore --agent ... --pod-uid NEW_POD_UID).
	RestoreViaAgent bool
	// MemoryFile renders the restored pod for a snapshot in the
	// memory-file format (a VM whose RAM is a shared memory-backend-file):
	// after the restore init container has staged the device state, the
	// vmsnap-prepare init container materializes the RAM file into the
	// pod's own RestoreRAMVolume (an emptyDir with medium: Memory, at most
	// RestoreRAMSizeLimit, mounted at RestoreRAMDir) and records the QEMU
	// arguments that map it in the state directory; vmsnap launch starts
	// QEMU with them and loads the device state over QMP. Each pod has its
	// own copy: no RAM file is shared across pods or tenants (QEMU before
	// 8.2 opens a share=off file read-write). Not with RestoreViaAgent.
	MemoryFile          bool
	RestoreRAMDir       string
	RestoreRAMVolume    string
	RestoreRAMSizeLimit resource.Quantity
	// BaseDir is the directory of the QEMU image that holds the overlay's
	// backing file; an init container copies it beside the restored overlay.
	BaseDir string

	// Resources of each container; a zero value means the defaults below
	// (DefaultAgentResources and so on).
	AgentResources   corev1.ResourceRequirements
	JobResources     corev1.ResourceRequirements
	RestoreResources corev1.ResourceRequirements
}

// withDefaults returns o with every zero field set to its default.
func (o Options) withDefaults() Options {
	def := func(s *string, v string) {
		if *s == "" {
			*s = v
		}
	}
	def(&o.Image, DefaultImage)
	if o.ImagePullPolicy == "" {
		o.ImagePullPolicy = corev1.PullIfNotPresent
	}
	def(&o.Namespace, DefaultNamespace)
	def(&o.Name, DefaultName)
	if o.SocketGroup == 0 {
		o.SocketGroup = DefaultSocketGroup
	}
	def(&o.KVMNodeLabel, DefaultKVMNodeLabel)
	def(&o.KVMNodeLabelValue, DefaultKVMNodeValue)
	def(&o.PullSecret, DefaultPullSecret)
	def(&o.SocketDir, DefaultSocketDir)
	def(&o.StateDir, DefaultStateDir)
	def(&o.ContainerdSocket, DefaultContainerdSocket)
	def(&o.ContainerdRoot, DefaultContainerdRoot)
	def(&o.KubeletPodsDir, DefaultKubeletPodsDir)
	if o.JobUser == 0 {
		o.JobUser = DefaultNonRootUser
	}
	def(&o.CheckpointMode, DefaultCheckpointMode)
	if o.JobActiveDeadlineSeconds == 0 {
		o.JobActiveDeadlineSeconds = DefaultJobActiveDeadlineSeconds
	}
	if o.JobTTLSecondsAfterFinished == 0 {
		o.JobTTLSecondsAfterFinished = DefaultJobTTLSecondsAfterFinish
	}
	if o.RestoreUser == 0 {
		o.RestoreUser = DefaultNonRootUser
	}
	if o.RestoreGroup == 0 {
		o.RestoreGroup = DefaultNonRootUser
	}
	def(&o.RestoreStateDir, DefaultRestoreStateDir)
	def(&o.RestoreStateVolume, DefaultRestoreStateVolume)
	if o.QMPSocket == "" {
		o.QMPSocket = DefaultQMPSocket
	}
	if o.RestoreStateSizeLimit.IsZero() {
		o.RestoreStateSizeLimit = resource.MustParse(DefaultRestoreStateLimit)
	}
	def(&o.RestoreDiskPath, DefaultRestoreDiskPath)
	def(&o.RestoreDiskVolume, DefaultRestoreDiskVolume)
	def(&o.RestoreMarkerDir, DefaultRestoreMarkerDir)
	def(&o.RestoreMarkerVolume, DefaultRestoreMarkerVolume)
	def(&o.RestoreRunVolume, DefaultRestoreRunVolume)
	def(&o.RestoreRAMDir, DefaultRestoreRAMDir)
	def(&o.RestoreRAMVolume, DefaultRestoreRAMVolume)
	if o.RestoreRAMSizeLimit.IsZero() {
		o.RestoreRAMSizeLimit = resource.MustParse(DefaultRestoreRAMLimit)
	}
	def(&o.OnRestart, DefaultOnRestart)
	def(&o.BaseDir, DefaultBaseDir)
	if isZeroResources(o.AgentResources) {
		o.AgentResources = DefaultAgentResources()
	}
	if isZeroResources(o.JobResources) {
		o.JobResources = DefaultJobResources()
	}
	if isZeroResources(o.RestoreResources) {
		o.RestoreResources = DefaultRestoreResources()
	}
	return o
}

func isZeroResources(r corev1.ResourceRequirements) bool {
	return len(r.Requests) == 0 && len(r.Limits) == 0 && len(r.Claims) == 0
}

func resources(req, lim [3]string) corev1.ResourceRequirements {
	list := func(v [3]string) corev1.ResourceList {
		return corev1.ResourceList{
			corev1.ResourceCPU:              resource.MustParse(v[0]),
			corev1.ResourceMemory:           resource.MustParse(v[1]),
			corev1.ResourceEphemeralStorage: resource.MustParse(v[2]),
		}
	}
	return corev1.ResourceRequirements{Requests: list(req), Limits: list(lim)}
}

// DefaultAgentResources: the agent idles at a few MiB; a checkpoint
// compresses on two cores and holds at most about 110 MiB of chunks and
// encoders (chunk.StreamOptions.EncodeMemory), two at once by default.
// Its root filesystem is read-only and its state is on a host path, so its
// ephemeral storage is its logs.
func DefaultAgentResources() corev1.ResourceRequirements {
	return resources([3]string{"100m", "128Mi", "64Mi"}, [3]string{"2", "1Gi", "256Mi"})
}

// DefaultJobResources: the Job is a thin client that waits on the agent.
func DefaultJobResources() corev1.ResourceRequirements {
	return resources([3]string{"10m", "32Mi", "16Mi"}, [3]string{"250m", "128Mi", "64Mi"})
}

// DefaultRestoreResources: the init container verifies every byte it pulls
// (SHA-256) on a few cores. Its ephemeral-storage limit is large on purpose:
// when the pod's other containers set none, the kubelet takes the init
// container's limit as the whole pod's, and counts every disk-backed
// emptyDir against it, the staged state and the disk overlay included.
func DefaultRestoreResources() corev1.ResourceRequirements {
	return resources([3]string{"250m", "128Mi", "1Gi"}, [3]string{"2", "512Mi", "16Gi"})
}

var (
	dnsLabel     = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	labelKeyName = regexp.MustCompile(`^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$`)
	capName      = regexp.MustCompile(`^[A-Z][A-Z0-9_]*$`)
	// shellSafe paths go unquoted into QEMU's exec: command line (vmsnap
	// launch refuses others).
	shellSafe = regexp.MustCompile(`^[A-Za-z0-9_./+:@=-]+$`)
)

func cleanAbs(p string) bool { return path.IsAbs(p) && path.Clean(p) == p }

// within reports whether p is dir or below it.
func within(p, dir string) bool {
	return p == dir || strings.HasPrefix(p, strings.TrimSuffix(dir, "/")+"/")
}
