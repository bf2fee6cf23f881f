package cluster

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Namespace creates a namespace named after prefix with labels, waits for
// its default ServiceAccount and returns its name. The cluster goes away
// with the test: it is not deleted.
func (c *Cluster) Namespace(t testing.TB, prefix string, labels map[string]string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ns, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{
		ObjectMeta: metav1.ObjectMeta{GenerateName: prefix + "-", Labels: labels},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating namespace: %v", err)
	}
	if err := c.waitDefaultServiceAccount(ns.Name); err != nil {
		t.Fatal(err)
	}
	return ns.Name
}

// RunPod creates pod and waits until it is Running with every container
// ready; on a timeout it fails t with the pod's status and events.
func (c *Cluster) RunPod(t testing.TB, ctx context.Context, pod *corev1.Pod) *corev1.Pod {
	t.Helper()
	created, err := c.Client.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating pod %s/%s: %v", pod.Namespace, pod.Name, err)
	}
	return c.WaitPodReady(t, ctx, created.Namespace, created.Name)
}

// WaitPodReady waits until the pod is Running and Ready.
func (c *Cluster) WaitPodReady(t testing.TB, ctx context.Context, ns, name string) *corev1.Pod {
	t.Helper()
	began := time.Now()
	p := c.WaitPod(t, ctx, ns, name, func(p *corev1.Pod) bool {
		return p.Status.Phase == corev1.PodRunning && podReady(p)
	})
	t.Logf("pod %s/%s Ready after %v", ns, name, time.Since(began).Round(time.Millisecond))
	return p
}

func podReady(p *corev1.Pod) bool {
	for _, cond := range p.Status.Conditions {
		if cond.Type == corev1.PodReady {
			return cond.Status == corev1.ConditionTrue
		}
	}
	return false
}

// WaitPod polls the pod until cond holds. It fails t with the pod's status
// and events if ctx ends first or the pod fails.
func (c *Cluster) WaitPod(t testing.TB, ctx context.Context, ns, name string, cond func(*corev1.Pod) bool) *corev1.Pod {
	t.Helper()
	var last *corev1.Pod
	for {
		p, err := c.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err == nil {
			last = p
			if cond(p) {
				return p
			}
			if p.Status.Phase == corev1.PodFailed || crashLooping(p) {
				t.Fatalf("pod %s/%s failed\n%s", ns, name, c.Describe(ns, "pod", name))
			}
		}
		select {
		case <-ctx.Done():
			phase := "not found"
			if last != nil {
				phase = string(last.Status.Phase)
			}
			t.Fatalf("pod %s/%s: condition not met (phase %s): %v\n%s", ns, name, phase, ctx.Err(), c.Describe(ns, "pod", name))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// crashLooping reports whether a container of the pod failed twice: a
// pod waited for is not meant to.
func crashLooping(p *corev1.Pod) bool {
	for _, st := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		if w := st.State.Waiting; w != nil && w.Reason == "CrashLoopBackOff" && st.RestartCount >= 2 {
			return true
		}
	}
	return false
}

// Describe is kubectl describe of an object, for failure messages.
func (c *Cluster) Describe(ns, kind, name string) string {
	out, err := c.KubectlErr(nil, "-n", ns, "describe", kind, name)
	if err != nil {
		return fmt.Sprintf("(kubectl describe %s %s: %v)", kind, name, err)
	}
	return out
}

// JobTerminationMessage waits until Job ns/name finishes and returns its
// pod's termination message (its first container's). A failed Job fails
// t, with the message.
func (c *Cluster) JobTerminationMessage(t testing.TB, ctx context.Context, ns, name string) string {
	t.Helper()
	var job *batchv1.Job
	for done := false; !done; {
		var err error
		job, err = c.Client.BatchV1().Jobs(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("job %s/%s: %v", ns, name, err)
		}
		done = job.Status.Succeeded > 0 || job.Status.Failed > 0
		if !done {
			select {
			case <-ctx.Done():
				t.Fatalf("job %s/%s did not finish: %v\n%s", ns, name, ctx.Err(), c.Describe(ns, "job", name))
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
	pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "batch.kubernetes.io/job-name=" + name})
	if err != nil || len(pods.Items) != 1 {
		t.Fatalf("job %s/%s: listing its pod: %v (%d pods)", ns, name, err, len(pods.Items))
	}
	p := pods.Items[0]
	var msg string
	if len(p.Status.ContainerStatuses) > 0 && p.Status.ContainerStatuses[0].State.Terminated != nil {
		msg = p.Status.ContainerStatuses[0].State.Terminated.Message
	}
	if job.Status.Succeeded == 0 {
		logs, _ := c.KubectlErr(nil, "-n", ns, "logs", p.Name)
		t.Fatalf("job %s/%s failed; termination message %q; logs:\n%s\n%s", ns, name, msg, strings.TrimSpace(logs), c.Describe(ns, "pod", p.Name))
	}
	return msg
}

// WaitPodGone waits until pod ns/name no longer exists.
func (c *Cluster) WaitPodGone(t testing.TB, ctx context.Context, ns, name string) {
	t.Helper()
	for {
		_, err := c.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("pod %s/%s still there: %v\n%s", ns, name, ctx.Err(), c.Describe(ns, "pod", name))
		case <-time.After(200 * time.Millisecond):
		}
	}
}
