package manifests

import (
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// EnvSourcePodUID carries the source pod's UID into the checkpoint Job; its
// --pod-uid argument refers to it as $(SOURCE_POD_UID).
const EnvSourcePodUID = "SOURCE_POD_UID"

// Checkpoint is what a controller knows about one checkpoint: which VM, on
// which node, into which images. Paths are as seen inside the QEMU
// container; the agent resolves them through containerd.
type Checkpoint struct {
	Name      string // the Job's name; empty: generated from "<Name>-checkpoint-"
	Node      string // the source pod's node (spec.nodeName)
	PodUID    string // the source pod's UID, never its name
	Container string // the QEMU container's name
	QMP       string // its QMP socket
	Disk      string // its qcow2 overlay; empty: the disk is not captured
	Image     string // where the VM state goes (REF)
	DiskImage string // where the disk overlay goes (REF), with Disk
	Mode      string // pause, snapshot or live; empty: Options.CheckpointMode
}

// Placeholders of JobTemplate, RestoreInitContainer and RestorePod, in the
// ${VAR} form envsubst replaces, each with one meaning in every part (see
// Placeholders). A controller uses CheckpointJob and RestoreInit instead.
// The repositories are the same in both: the Job pushes to
// ${STATE_REPO}:${TAG}, the restore pulls ${STATE_REPO}@${STATE_DIGEST}.
var (
	TemplateCheckpoint = Checkpoint{
		Node:      "${NODE_NAME}",
		PodUID:    "${SOURCE_POD_UID}",
		Container: "${QEMU_CONTAINER}",
		QMP:       "${QMP_SOCKET}",
		Disk:      "${DISK_PATH}",
		Image:     "${STATE_REPO}:${TAG}",
		DiskImage: "${DISK_REPO}:${TAG}",
	}
	TemplateRestore = Restore{
		Image:     "${STATE_REPO}@${STATE_DIGEST}",
		DiskImage: "${DISK_REPO}@${DISK_DIGEST}",
	}
)

// Placeholders says what each ${VAR} of the templates means: the comment
// at the top of each part lists the ones it uses from here.
var Placeholders = map[string]string{
	"${NODE_NAME}":      "the source pod's node (its spec.nodeName)",
	"${SOURCE_POD_UID}": "the source pod's UID (metadata.uid), never its name",
	"${QEMU_CONTAINER}": "the source pod's QEMU container's name",
	"${QMP_SOCKET}":     "its QMP socket, as the container sees it (e.g. " + DefaultQMPSocket + ")",
	"${DISK_PATH}":      "its qcow2 overlay, as the container sees it (e.g. " + DefaultRestoreDiskPath + ")",
	"${STATE_REPO}":     "the VM state's repository, HOST[:PORT]/PATH, with neither tag nor digest",
	"${DISK_REPO}":      "the disk overlay's repository, HOST[:PORT]/PATH, with neither tag nor digest",
	"${TAG}":            "the checkpoint's tag in both repositories",
	"${STATE_DIGEST}":   "sha256:HEX, the checkpoint result's vmstate.digest (the Job's termination message), or its checkpoint.digest (the checkpoint's index, from which restore takes the state)",
	"${DISK_DIGEST}":    "sha256:HEX, the checkpoint result's disk.digest, or its checkpoint.digest with ${DISK_REPO} the state's repository (restore takes the disk from the checkpoint, from another repository of the same registry if the checkpoint links it there)",
	"${BACKING_FILE}":   "the overlay's backing file name, the checkpoint result's disk.backingFile (e.g. base.qcow2)",
	"${QEMU_IMAGE}":     "the QEMU image: qemu-system-x86_64, vmsnap, /bin/sh and cp, and the backing file in the base directory, readable by the restore user",
	"${QEMU_ARGS}":      "the source VM's exact QEMU options as a JSON array of strings, without -incoming; with -device vmgenid,guid=auto, so that each restored clone gets a fresh VM generation ID",
	"${POD_NAME}":       "the restored pod's name",
	"${NAMESPACE}":      "the restored pod's namespace (the source's), with the pull secret (and CA ConfigMap) in it",
}

// JobTemplate is the checkpoint Job with placeholders for what the
// controller fills in (TemplateCheckpoint).
func JobTemplate(o Options) *batchv1.Job { return CheckpointJob(o, TemplateCheckpoint) }

// CheckpointArgs is the Job's command line: the thin client that asks the
// agent on the node to checkpoint and writes the result JSON to the
// termination log.
func CheckpointArgs(o Options, c Checkpoint) []string {
	o = o.withDefaults()
	mode := c.Mode
	if mode == "" {
		mode = o.CheckpointMode
	}
	args := []string{
		"vmsnap", "checkpoint",
		"--agent", "unix://" + AgentSocket(o),
		"--json",
		"--termination-log", TerminationLog,
		"--pod-uid", "$(" + EnvSourcePodUID + ")",
		"--container", c.Container,
		"--qmp", c.QMP,
		"--image", c.Image,
	}
	if c.Disk != "" || c.DiskImage != "" {
		args = append(args, "--disk", c.Disk, "--disk-image", c.DiskImage)
	}
	return append(args, "--mode", mode)
}

// CheckpointJob is the Job that checkpoints one VM: on the source pod's
// node, as non-root, with nothing from the node but the agent's socket
// directory, read-only.
func CheckpointJob(o Options, c Checkpoint) *batchv1.Job {
	o = o.withDefaults()
	meta := metav1.ObjectMeta{Namespace: o.Namespace, Labels: labels(o, ComponentCheckpoint)}
	if c.Name != "" {
		meta.Name = c.Name
	} else {
		meta.GenerateName = o.Name + "-checkpoint-"
	}
	podLabels := labels(o, ComponentCheckpoint)
	if c.PodUID != "" {
		meta.Labels[LabelSourcePodUID] = c.PodUID
		podLabels[LabelSourcePodUID] = c.PodUID
	}
	container := corev1.Container{
		Name:            "checkpoint",
		Image:           o.Image,
		ImagePullPolicy: o.ImagePullPolicy,
		Command:         CheckpointArgs(o, c),
		Env:             []corev1.EnvVar{{Name: EnvSourcePodUID, Value: c.PodUID}},
		Resources:       o.JobResources,
		VolumeMounts: []corev1.VolumeMount{
			{Name: volSocket, MountPath: o.SocketDir, ReadOnly: true},
		},
		// The result JSON, not the progress lines, is the pod's
		// termination message: the controller reads the digests there.
		TerminationMessagePath:   TerminationLog,
		TerminationMessagePolicy: corev1.TerminationMessageReadFile,
		SecurityContext:          securityContext(o.JobUser, o.JobUser),
	}
	return &batchv1.Job{
		TypeMeta:   metav1.TypeMeta{APIVersion: "batch/v1", Kind: "Job"},
		ObjectMeta: meta,
		Spec: batchv1.JobSpec{
			// A failed checkpoint is reported, not retried: in pause mode
			// the agent has already continued the VM, and whether to try
			// again is the controller's call.
			BackoffLimit:            ptr(int32(0)),
			ActiveDeadlineSeconds:   ptr(o.JobActiveDeadlineSeconds),
			TTLSecondsAfterFinished: ptr(o.JobTTLSecondsAfterFinished),
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: podLabels},
				Spec: corev1.PodSpec{
					NodeName:                     c.Node,
					Tolerations:                  o.Tolerations,
					RestartPolicy:                corev1.RestartPolicyNever,
					ServiceAccountName:           o.Name,
					AutomountServiceAccountToken: ptr(false),
					EnableServiceLinks:           ptr(false),
					ImagePullSecrets:             pullSecrets(o),
					SecurityContext:              podSecurityContext(o.SocketGroup),
					Containers:                   []corev1.Container{container},
					Volumes: []corev1.Volume{
						// Directory, not DirectoryOrCreate: no agent, no Job.
						hostPathVolume(volSocket, o.SocketDir, corev1.HostPathDirectory),
					},
				},
			},
		},
	}
}
