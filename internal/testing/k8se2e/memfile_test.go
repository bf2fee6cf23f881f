package k8se2e

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/vmsnap/vmsnap/internal/manifests"
	"github.com/vmsnap/vmsnap/internal/testing/cluster"
	"github.com/vmsnap/vmsnap/internal/testing/guest"
)

const (
	ramDir  = "/vm/ram"
	ramFile = ramDir + "/guest.ram"
)

// memoryFile is the memory-file variant of the scenario: a source VM whose
// RAM is a shared file on an emptyDir with medium: Memory, checkpointed by
// the Job through the agent (which opens the file within the pod, as its
// resolver opens the disk), and restored by `vmsnap manifests --part
// restore --memory-file` as printed: the pod's own RAM volume filled by
// vmsnap-prepare, QEMU started by vmsnap launch, the device state loaded
// by vmsnap load. The guest carries on where it stopped.
func (s *scenario) memoryFile(t *testing.T) {
	c := s.c
	if s.vmNS == "" {
		s.vmNS = c.Namespace(t, vmNamespacePrefix, map[string]string{"pod-security.kubernetes.io/enforce": "restricted"})
		s.registryObjects(t, s.vmNS)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	mounts := []corev1.VolumeMount{{Name: "vm-disk", MountPath: "/vm/disk"}, {Name: "vm-run", MountPath: "/vm/run"}, {Name: "vm-ram", MountPath: ramDir}}
	args := append(qemuArgs(), "-object", "memory-backend-file,id=ram0,mem-path="+ramFile+",share=on,size=256M", "-machine", "memory-backend=ram0")
	limit := resource.MustParse("512Mi")
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "source-memfile", Namespace: s.vmNS},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken: ptr(false),
			SecurityContext:              &corev1.PodSecurityContext{SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}},
			InitContainers: []corev1.Container{{
				Name: "disk", Image: s.qemuImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"/bin/sh", "-c", "cp " + cluster.QEMUImageBaseDisk + " /vm/disk/" + backingFile +
					" && qemu-img create -q -f qcow2 -b " + backingFile + " -F qcow2 " + diskPath},
				VolumeMounts: mounts[:1], SecurityContext: restricted(),
			}},
			Containers: []corev1.Container{{
				Name: "qemu", Image: s.qemuImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{guest.QEMUBinary}, Args: args,
				VolumeMounts: mounts, SecurityContext: restricted(),
			}},
			Volumes: []corev1.Volume{
				{Name: "vm-disk", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
				{Name: "vm-run", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
				{Name: "vm-ram", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{Medium: corev1.StorageMediumMemory, SizeLimit: &limit}}},
			},
		},
	}
	src := c.RunPod(t, ctx, pod)
	first := s.waitStatus(t, ctx, src, func(st guest.Status) bool { return st.Counter >= 3 })
	t.Logf("memory-file source guest: %s", first)

	job := manifests.CheckpointJob(s.opts, manifests.Checkpoint{
		Name: "checkpoint-memfile", Node: src.Spec.NodeName, PodUID: string(src.UID),
		Container: "qemu", QMP: qmpSocket, Disk: diskPath, Mode: "snapshot",
		Image: s.reg.Host + "/vms/memstate:1", DiskImage: s.reg.Host + "/vms/memdisk:1",
	})
	if _, err := c.Client.BatchV1().Jobs(job.Namespace).Create(ctx, job, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	msg := c.JobTerminationMessage(t, ctx, job.Namespace, job.Name)
	var out struct {
		VMState struct {
			Image, Digest, Format string
			RAM                   *struct{ Capture, CaptureNote string }
		} `json:"vmstate"`
		Disk *struct{ Digest string } `json:"disk"`
	}
	if err := json.Unmarshal([]byte(msg), &out); err != nil || out.Disk == nil || !isDigest(out.VMState.Digest) {
		t.Fatalf("termination message %q: %v", msg, err)
	}
	if out.VMState.Format != "memory-file" {
		t.Fatalf("the agent checkpointed format %q, want memory-file (the RAM file on the pod's Memory emptyDir)", out.VMState.Format)
	}
	// Snapshot mode: the pod's QEMU is 7.2 under TCG, whose dirty log a
	// pre-copy cannot trust, so the agent scans the stopped VM's file and
	// says why (on a KVM node it pre-copies: vmstate's tests).
	if r := out.VMState.RAM; r == nil || r.Capture != "scan" || !strings.Contains(r.CaptureNote, "TCG") {
		t.Fatalf("the agent's snapshot captured the RAM by %+v, want a scan, saying why", r)
	}
	sts, err := s.statuses(ctx, src, false)
	if err != nil || len(sts) == 0 {
		t.Fatalf("source guest's statuses: %v", err)
	}
	last := sts[len(sts)-1]
	if err := c.Client.CoreV1().Pods(s.vmNS).Delete(ctx, src.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	c.WaitPodGone(t, ctx, s.vmNS, src.Name)

	// The restored pod as printed, with the source's options minus its
	// RAM backend: the launcher maps the prepared file.
	qargs, err := json.Marshal(qemuArgs())
	if err != nil {
		t.Fatal(err)
	}
	yaml := fill(t, s.manifests(t, "restore", "--memory-file", "--ram-size-limit", "512Mi"), map[string]string{
		"POD_NAME": "restored-memfile", "NAMESPACE": s.vmNS, "QEMU_IMAGE": s.qemuImage, "QEMU_ARGS": string(qargs),
		"BACKING_FILE": backingFile,
		"STATE_REPO":   s.reg.Host + "/vms/memstate", "STATE_DIGEST": out.VMState.Digest,
		"DISK_REPO": s.reg.Host + "/vms/memdisk", "DISK_DIGEST": out.Disk.Digest,
	})
	s.apply(t, yaml)
	restored := c.WaitPodReady(t, ctx, s.vmNS, "restored-memfile")
	st := s.waitStatus(t, ctx, restored, func(st guest.Status) bool { return st.Counter > last.Counter })
	if st.Boot != last.Boot || st.Mem0 != last.Mem0 || st.Mem != st.Mem0 || st.Disk != last.Disk {
		t.Fatalf("restored guest: %s\nsource guest: %s\nwant the same boot, memory and disk", st, last)
	}
	logs, err := c.Client.CoreV1().Pods(s.vmNS).GetLogs(restored.Name, &corev1.PodLogOptions{Container: "qemu"}).DoRaw(ctx)
	if err != nil || !strings.Contains(string(logs), "vmsnap load: loaded "+out.VMState.Digest) {
		t.Errorf("the qemu container's log does not show vmsnap load (%v):\n%s", err, s.logTail(restored))
	}
	t.Logf("memory-file restore of %s carries on: %s", out.VMState.Digest, st)
	if err := c.Client.CoreV1().Pods(s.vmNS).Delete(ctx, restored.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}
