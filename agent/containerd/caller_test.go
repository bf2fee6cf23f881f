package containerd

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
	testcontainerd "github.com/vmsnap/vmsnap/internal/testing/containerd"
)

// CallerContainer places a container's process in its pod's namespace,
// refuses a process that is not one of a known container's, and skips IDs
// containerd does not know.
func TestCallerContainer(t *testing.T) {
	e := newEnv(t)
	other := e.d.Create(t, testcontainerd.PodContainer{PodUID: testcontainerd.NewPodUID(), PodNamespace: "tenant-a", PodName: "job", Name: "vmsnap"})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	pid := int(other.Task.Pid())
	unknown := testcontainerd.NewID()

	c, ok, err := e.r.CallerContainer(ctx, pid, []string{unknown, other.ID})
	if err != nil || !ok || c.PodNamespace != "tenant-a" || c.PodName != "job" || c.Name != "vmsnap" || c.ID != other.ID {
		t.Fatalf("the task's own process: %+v, %v, %v; want tenant-a's job container", c, ok, err)
	}
	// A process in a cgroup named like a container, but not its process.
	if _, ok, err := e.r.CallerContainer(ctx, os.Getpid(), []string{e.c.ID, other.ID}); ok || errcode.Of(err) != errcode.Forbidden {
		t.Fatalf("a process that is not the container's: %v, %v; want FORBIDDEN", ok, err)
	}
	// The pid of another container's task is not this one's.
	if _, ok, err := e.r.CallerContainer(ctx, pid, []string{e.c.ID}); ok || errcode.Of(err) != errcode.Forbidden {
		t.Fatalf("tenant-a's process claimed by another container: %v, %v; want FORBIDDEN", ok, err)
	}
	if _, ok, err := e.r.CallerContainer(ctx, pid, []string{unknown}); ok || err != nil {
		t.Fatalf("an ID containerd does not know: %v, %v; want not found", ok, err)
	}
}
