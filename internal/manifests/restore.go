package manifests

import (
	"fmt"
	"path"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// RestoreContainerName is the name of the restore init container.
const RestoreContainerName = "vmsnap-restore"

// Restore names the snapshot a restored pod starts from, by digest: the
// init container refuses a tag. At least one of the two is needed.
type Restore struct {
	// Image is the VM state, REF@sha256:..., staged for vmsnap launch
	// --state-dir. Empty: the agent loads the state into a QEMU started
	// with -incoming defer (vmsnap launch --defer), and the init container
	// restores the disk only.
	Image string
	// DiskImage is the disk overlay, REF@sha256:...; empty: no disk.
	DiskImage string
	// MemoryFile: Image is in the memory-file format; its RAM file is
	// prepared into the pod's RAM volume (PrepareInit) and QEMU maps it.
	MemoryFile bool
}

// PrepareContainerName is the name of the init container that prepares a
// memory-file snapshot's RAM file (PrepareInit).
const PrepareContainerName = "vmsnap-prepare"

// PrepareArgs is PrepareInit's command line: the RAM file materialized in
// the pod's RAM volume (a cache directory of its own below it: the
// emptyDir's root is not the container user's), every region verified,
// and the QEMU arguments recorded in the state directory for vmsnap launch.
func PrepareArgs(o Options, r Restore) []string {
	o = o.withDefaults()
	// The emptyDir's root is world-writable, but only this pod sees it.
	args := []string{"vmsnap", "prepare", r.Image, "--cache-dir", path.Join(o.RestoreRAMDir, "cache"), "--private-volume", "--state-dir", o.RestoreStateDir, "--json"}
	if o.RegistryCAConfigMap != "" {
		args = append(args, "--ca-file", RegistryCADir+"/"+RegistryCAKey)
	}
	return args
}

// PrepareInit is the init container that runs after RestoreInit for a
// memory-file snapshot (r.MemoryFile), and the volume it adds: the RAM
// volume, an emptyDir with medium: Memory (its pages are what QEMU maps)
// of at most RestoreRAMSizeLimit, which counts against the pod's memory.
// It is the pod's own copy of the RAM file: nothing is shared with other
// pods, so a QEMU that writes the file (QEMU before 8.2 opens it
// read-write) reaches only its own pod's.
func PrepareInit(o Options, r Restore) (corev1.Container, []corev1.Volume) {
	o = o.withDefaults()
	mounts := []corev1.VolumeMount{
		{Name: o.RestoreStateVolume, MountPath: o.RestoreStateDir},
		ramMount(o),
		registryMount(),
	}
	vols := []corev1.Volume{{Name: o.RestoreRAMVolume, VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{
		Medium: corev1.StorageMediumMemory, SizeLimit: ptr(o.RestoreRAMSizeLimit)}}}}
	if o.RegistryCAConfigMap != "" {
		mounts = append(mounts, registryCAMount())
	}
	// The tmpfs pages it writes are charged to its memory cgroup: its
	// limit must hold the whole RAM file besides its own needs.
	res := *o.RestoreResources.DeepCopy()
	if res.Limits == nil {
		res.Limits = corev1.ResourceList{}
	}
	mem := o.RestoreRAMSizeLimit.DeepCopy()
	if own, ok := res.Limits[corev1.ResourceMemory]; ok {
		mem.Add(own)
	}
	res.Limits[corev1.ResourceMemory] = mem
	return corev1.Container{
		Name:                     PrepareContainerName,
		Image:                    o.Image,
		ImagePullPolicy:          o.ImagePullPolicy,
		Command:                  PrepareArgs(o, r),
		Env:                      []corev1.EnvVar{registryEnv()},
		Resources:                res,
		VolumeMounts:             mounts,
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
		SecurityContext:          securityContext(o.RestoreUser, o.RestoreGroup),
	}, vols
}

func ramMount(o Options) corev1.VolumeMount {
	return corev1.VolumeMount{Name: o.RestoreRAMVolume, MountPath: o.RestoreRAMDir}
}

// RestoreArgs is the init container's command line: pull and verify the
// disk overlay into place and the VM state into the state volume, once per
// pod (--marker-dir).
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
	args = append(args, "--marker-dir", o.RestoreMarkerDir)
	if o.RegistryCAConfigMap != "" {
		args = append(args, "--ca-file", RegistryCADir+"/"+RegistryCAKey)
	}
	if o.DecryptionKeySecret != "" {
		args = append(args, "--decryption-key", DecryptionKeyDir+"/"+DecryptionKeyName)
	}
	return args
}

// LaunchCommand is the QEMU container's command: vmsnap launch, which
// starts QEMU (the command's last word; its options go in the container's
// args) so that the snapshot is loaded once per pod. With a state Image,
// QEMU loads the state the init container staged through vmsnap stream;
// without one, QEMU waits with -incoming defer for the agent to load it.
// On a restart of the container, it boots cold from the disk or fails, as
// OnRestart says. The QEMU image needs vmsnap and /bin/sh.
func LaunchCommand(o Options, r Restore) []string {
	o = o.withDefaults()
	cmd := []string{"vmsnap", "launch"}
	if r.Image != "" {
		cmd = append(cmd, "--state-dir", o.RestoreStateDir, "--qmp", o.QMPSocket)
	} else {
		cmd = append(cmd, "--defer")
	}
	return append(cmd, "--marker-dir", o.RestoreMarkerDir, "--on-restart", o.OnRestart, "--", "qemu-system-x86_64")
}

// QEMUMounts are the volume mounts of the QEMU container: the disk, the
// state (read-only; with a state Image), the QMP socket's directory and the
// markers. With the read-only root file system, these are all it may write.
func QEMUMounts(o Options, r Restore) []corev1.VolumeMount {
	o = o.withDefaults()
	m := []corev1.VolumeMount{diskMount(o)}
	if r.Image != "" {
		m = append(m, corev1.VolumeMount{Name: o.RestoreStateVolume, MountPath: o.RestoreStateDir, ReadOnly: true})
	}
	if r.MemoryFile && r.Image != "" {
		// Writable: QEMU before 8.2 opens its share=off RAM file
		// read-write (it never writes it: the mapping is private).
		m = append(m, ramMount(o))
	}
	return append(m,
		corev1.VolumeMount{Name: o.RestoreRunVolume, MountPath: path.Dir(o.QMPSocket)},
		markerMount(o))
}

func diskMount(o Options) corev1.VolumeMount {
	return corev1.VolumeMount{Name: o.RestoreDiskVolume, MountPath: path.Dir(o.RestoreDiskPath)}
}

func markerMount(o Options) corev1.VolumeMount {
	return corev1.VolumeMount{Name: o.RestoreMarkerVolume, MountPath: o.RestoreMarkerDir}
}

func emptyDir(name string, limit *resource.Quantity) corev1.Volume {
	return corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{SizeLimit: limit}}}
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
// name takes its place, see AddRestore), the markers (a disk-backed
// emptyDir), the registry credentials (the PullSecret, which must exist in
// the pod's namespace) and, with RegistryCAConfigMap, the registry's CA.
//
// It runs as RestoreUser, non-root, with nothing writable but its
// emptyDirs and the disk volume, no capabilities and the runtime's seccomp
// profile: admissible in a namespace that enforces the restricted Pod
// Security Standard.
func RestoreInit(o Options, r Restore) (corev1.Container, []corev1.Volume) {
	o = o.withDefaults()
	var mounts []corev1.VolumeMount
	var vols []corev1.Volume
	if r.Image != "" {
		mounts = append(mounts, corev1.VolumeMount{Name: o.RestoreStateVolume, MountPath: o.RestoreStateDir})
		vols = append(vols, emptyDir(o.RestoreStateVolume, ptr(o.RestoreStateSizeLimit)))
	}
	if r.DiskImage != "" {
		mounts = append(mounts, diskMount(o))
		vols = append(vols, emptyDir(o.RestoreDiskVolume, nil))
	}
	// Markers are a few hundred bytes; disk-backed (not medium: Memory), so
	// that a node reboot, which recreates the sandbox, keeps them.
	mounts = append(mounts, markerMount(o), registryMount())
	vols = append(vols, emptyDir(o.RestoreMarkerVolume, ptr(resource.MustParse("1Mi"))))
	// 0444: a secret volume's files belong to root (and to the pod's
	// fsGroup, which is not ours to set), and the init container is not
	// root. Only containers that mount this volume see it.
	vols = append(vols, registryVolume(o, 0o444))
	if o.RegistryCAConfigMap != "" {
		mounts = append(mounts, registryCAMount())
		vols = append(vols, registryCAVolume(o))
	}
	if o.DecryptionKeySecret != "" {
		mounts = append(mounts, corev1.VolumeMount{Name: VolumeDecryptionKey, MountPath: DecryptionKeyDir, ReadOnly: true})
		vols = append(vols, decryptionKeyVolume(o))
	}
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

// BackingInit is an init container that copies the overlay's backing file,
// named backing (relative, as the checkpoint result's disk.backingFile
// says), from BaseDir in the QEMU image to the disk volume beside the
// overlay, where QEMU looks for it. It copies to a temporary name and
// renames, and leaves a backing file already there (a pod's own disk
// volume, or an earlier run) alone. It runs before the restore init
// container, which checks that the backing file is there.
func BackingInit(o Options, qemuImage, backing string) corev1.Container {
	o = o.withDefaults()
	dst := path.Join(path.Dir(o.RestoreDiskPath), backing)
	return corev1.Container{
		Name:  BackingContainerName,
		Image: qemuImage,
		// Positional parameters rather than shell variables: envsubst
		// leaves $1 and $2 alone.
		Command: []string{"/bin/sh", "-c", `set -e; [ -e "$2" ] || { cp -- "$1" "$2.vmsnap-tmp"; mv -- "$2.vmsnap-tmp" "$2"; }`,
			"copy-backing-file", path.Join(o.BaseDir, backing), dst},
		// As small as the Job's: cp needs little, and the copy lands on
		// the disk volume, counted against the pod, not this container.
		Resources:                DefaultJobResources(),
		VolumeMounts:             []corev1.VolumeMount{diskMount(o)},
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
		SecurityContext:          securityContext(o.RestoreUser, o.RestoreGroup),
	}
}

// BackingContainerName is the name of BackingInit's container.
const BackingContainerName = "vm-backing-file"

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
			have[v.Name] = true
		}
	}
	spec.InitContainers = append(spec.InitContainers, c)
	return nil
}

// RestoreTemplate is TemplateRestore, or with RestoreViaAgent its disk
// alone: the agent loads the state.
func RestoreTemplate(o Options) Restore {
	if o.RestoreViaAgent {
		return Restore{DiskImage: TemplateRestore.DiskImage}
	}
	r := TemplateRestore
	r.MemoryFile = o.MemoryFile
	return r
}

// QEMUArgsPlaceholder stands for the source VM's exact QEMU options in
// RestorePod. Render writes it as the whole value of the QEMU container's
// args (args: ${QEMU_ARGS}), to be filled with a JSON array of strings.
const QEMUArgsPlaceholder = "${QEMU_ARGS}"

// RestorePod is a restored pod with placeholders (TemplateRestore,
// ${QEMU_IMAGE}, ${BACKING_FILE}, QEMUArgsPlaceholder, ${POD_NAME},
// ${NAMESPACE}): the backing file's init container, the restore init
// container, then QEMU started by vmsnap launch, every container as
// RestoreUser with a read-only root file system and a volume for each path
// it writes.
func RestorePod(o Options) *corev1.Pod {
	o = o.withDefaults()
	r := RestoreTemplate(o)
	ic, vols := RestoreInit(o, r)
	sc := podSecurityContext()
	if o.DecryptionKeySecret != "" {
		// The decryption key's file is 0440, group fsGroup: readable by
		// the init container, which is not root.
		sc.FSGroup = ptr(o.RestoreGroup)
	}
	spec := corev1.PodSpec{
		AutomountServiceAccountToken: ptr(false),
		EnableServiceLinks:           ptr(false),
		SecurityContext:              sc,
		InitContainers:               []corev1.Container{BackingInit(o, "${QEMU_IMAGE}", "${BACKING_FILE}")},
		Containers: []corev1.Container{{
			Name:            "qemu",
			Image:           "${QEMU_IMAGE}",
			ImagePullPolicy: o.ImagePullPolicy,
			Command:         LaunchCommand(o, r),
			Args:            []string{QEMUArgsPlaceholder},
			VolumeMounts:    QEMUMounts(o, r),
			// vmsnap launch's message (--on-restart fail) in the pod's status.
			TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
			// The same user as the init containers, so that QEMU can open
			// the overlay and the state they wrote.
			SecurityContext: securityContext(o.RestoreUser, o.RestoreGroup),
		}},
		Volumes: []corev1.Volume{emptyDir(o.RestoreRunVolume, ptr(resource.MustParse("1Mi")))},
	}
	if err := AddRestore(&spec, ic, vols); err != nil {
		panic(err) // cannot happen: the spec is ours
	}
	if r.MemoryFile && r.Image != "" {
		pc, pvols := PrepareInit(o, r)
		if err := AddRestore(&spec, pc, pvols); err != nil {
			panic(err)
		}
	}
	return &corev1.Pod{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{
			Name: "${POD_NAME}", Namespace: "${NAMESPACE}",
			Labels: labels(o, ComponentRestore),
		},
		Spec: spec,
	}
}
