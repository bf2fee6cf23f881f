package manifests

import (
	"fmt"
	"path"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// RestoreContainerName is the name of the restore init container.
const RestoreContainerName = "vmsnap-restore"

// Restore names the snapshot a restored pod starts from, by digest: the
// init container refuses a tag. At least one of the two is needed.
type Restore struct {
	// Image is the VM state, REF@sha256:..., staged for IncomingExec.
	// Empty: the agent loads the state into a QEMU started with
	// IncomingDefer, and the init container restores the disk only.
	Image string
	// DiskImage is the disk overlay, REF@sha256:...; empty: no disk.
	DiskImage string
}

// RestoreArgs is the init container's command line: pull and verify the
// disk overlay into place and the VM state into the state volume.
func RestoreArgs(o Options, r Restore) []string {
	o = o.withDefaults()
	args := []string{"vmsnap", "restore"}
	if r.Image != "" {
		args = append(args, "--image", r.Image)
	}
	if r.DiskImage != "" {
		args = append(args, "--disk-image", r.DiskImage, "--disk", o.RestoreDiskPath)
	}
	if r.Image != "" {
		// Refuse an image the state volume could not hold before pulling it,
		// rather than be evicted half-way.
		args = append(args, "--to-dir", o.RestoreStateDir, "--max-bytes", strconv.FormatInt(o.RestoreStateSizeLimit.Value(), 10))
	}
	return args
}

// IncomingExec are the QEMU arguments that load the state the init
// container staged, through `vmsnap stream` (the QEMU image needs /bin/sh
// and vmsnap for it). Add them to the source VM's exact options. vmsnap
// stream continues the VM over QEMU's monitor (QMPSocket) once it is loaded:
// the stream records the stopped VM of the checkpoint.
func IncomingExec(o Options) []string {
	o = o.withDefaults()
	return []string{"-incoming", "exec:vmsnap stream --dir " + o.RestoreStateDir + " --qmp " + o.QMPSocket}
}

// IncomingDefer are the QEMU arguments for a restore driven by the agent:
// QEMU waits, the agent checks it matches the recorded VM, then streams the
// state in over QMP. The init container then only needs to put the disk in
// place (the state volume goes unused).
func IncomingDefer() []string { return []string{"-incoming", "defer"} }

// StateMount mounts the staged state, read-only, in the QEMU container that
// loads it with IncomingExec.
func StateMount(o Options) corev1.VolumeMount {
	o = o.withDefaults()
	return corev1.VolumeMount{Name: o.RestoreStateVolume, MountPath: o.RestoreStateDir, ReadOnly: true}
}

// DiskMount mounts the disk volume, where the overlay is, at the directory of
// RestoreDiskPath.
func DiskMount(o Options) corev1.VolumeMount {
	o = o.withDefaults()
	return corev1.VolumeMount{Name: o.RestoreDiskVolume, MountPath: path.Dir(o.RestoreDiskPath)}
}

// RestoreInitContainer is the restore init container with placeholders for
// the image references (TemplateRestore), and the volumes it needs.
func RestoreInitContainer(o Options) (corev1.Container, []corev1.Volume) {
	return RestoreInit(o, TemplateRestore)
}

// RestoreInit is the init container that pulls and verifies a snapshot into
// the restored pod before QEMU starts, and the volumes it mounts: the
// staged state (an emptyDir with a size limit; with r.Image), the disk
// volume (with r.DiskImage; an emptyDir here, but a pod's own volume of that
// name takes its place, see AddRestore) and the registry credentials (the
// PullSecret, which must exist in the pod's namespace).
//
// It runs as RestoreUser, non-root, with nothing writable but those two
// volumes, no capabilities and the runtime's seccomp profile.
func RestoreInit(o Options, r Restore) (corev1.Container, []corev1.Volume) {
	o = o.withDefaults()
	var mounts []corev1.VolumeMount
	var vols []corev1.Volume
	if r.Image != "" {
		mounts = append(mounts, corev1.VolumeMount{Name: o.RestoreStateVolume, MountPath: o.RestoreStateDir})
		vols = append(vols, corev1.Volume{Name: o.RestoreStateVolume, VolumeSource: corev1.VolumeSource{
			EmptyDir: &corev1.EmptyDirVolumeSource{SizeLimit: ptr(o.RestoreStateSizeLimit)},
		}})
	}
	if r.DiskImage != "" {
		mounts = append(mounts, DiskMount(o))
		vols = append(vols, corev1.Volume{Name: o.RestoreDiskVolume, VolumeSource: corev1.VolumeSource{
			EmptyDir: &corev1.EmptyDirVolumeSource{},
		}})
	}
	mounts = append(mounts, registryMount())
	// 0444: a secret volume's files belong to root (and to the pod's
	// fsGroup, which is not ours to set), and the init container is not
	// root. Only containers that mount this volume see it.
	vols = append(vols, registryVolume(o, 0o444))
	c := corev1.Container{
		Name:                     RestoreContainerName,
		Image:                    o.Image,
		ImagePullPolicy:          o.ImagePullPolicy,
		Command:                  RestoreArgs(o, r),
		Env:                      []corev1.EnvVar{registryEnv()},
		Resources:                o.RestoreResources,
		VolumeMounts:             mounts,
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
		SecurityContext:          securityContext(o.RestoreUser, o.RestoreGroup),
	}
	return c, vols
}

// AddRestore adds the restore init container to a pod spec, after any
// init containers it has (they may prepare the disk volume, such as the
// overlay's backing file), and each volume the spec does not already have
// by name: a pod's own disk volume is kept.
func AddRestore(spec *corev1.PodSpec, c corev1.Container, vols []corev1.Volume) error {
	for _, ic := range spec.InitContainers {
		if ic.Name == c.Name {
			return fmt.Errorf("manifests: the pod already has an init container %q", c.Name)
		}
	}
	for _, cc := range spec.Containers {
		if cc.Name == c.Name {
			return fmt.Errorf("manifests: the pod already has a container %q", c.Name)
		}
	}
	have := map[string]bool{}
	for _, v := range spec.Volumes {
		have[v.Name] = true
	}
	for _, v := range vols {
		if !have[v.Name] {
			spec.Volumes = append(spec.Volumes, v)
		}
	}
	spec.InitContainers = append(spec.InitContainers, c)
	return nil
}

// RestoreExample is a PodTemplate showing a restored pod: the init
// container, then QEMU started with IncomingExec. It is documentation (a
// PodTemplate runs nothing), with placeholders for the QEMU image.
func RestoreExample(o Options) *corev1.PodTemplate {
	o = o.withDefaults()
	ic, vols := RestoreInitContainer(o)
	spec := corev1.PodSpec{
		AutomountServiceAccountToken: ptr(false),
		SecurityContext:              podSecurityContext(),
		Containers: []corev1.Container{{
			Name:         "qemu",
			Image:        "${QEMU_IMAGE}",
			Command:      []string{"qemu-system-x86_64"},
			Args:         IncomingExec(o),
			VolumeMounts: []corev1.VolumeMount{DiskMount(o), StateMount(o)},
			// The same user as the init container, so that QEMU can open
			// the overlay and the state it wrote.
			SecurityContext: securityContext(o.RestoreUser, o.RestoreGroup),
		}},
	}
	if err := AddRestore(&spec, ic, vols); err != nil {
		panic(err) // cannot happen: the spec is ours
	}
	return &corev1.PodTemplate{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "PodTemplate"},
		ObjectMeta: metav1.ObjectMeta{
			Name: o.Name + "-restore-example", Namespace: o.Namespace,
			Labels: labels(o, ComponentRestore),
		},
		Template: corev1.PodTemplateSpec{
			ObjectMeta: metav1.ObjectMeta{Labels: labels(o, ComponentRestore)},
			Spec:       spec,
		},
	}
}
