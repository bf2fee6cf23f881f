package containerd

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// The labels the kubelet's CRI plugin puts on a pod's containers.
const (
	LabelPodUID        = "io.kubernetes.pod.uid"
	LabelPodName       = "io.kubernetes.pod.name"
	LabelPodNamespace  = "io.kubernetes.pod.namespace"
	LabelContainerName = "io.kubernetes.container.name"
	LabelKind          = "io.cri-containerd.kind" // "container" or "sandbox"
)

// DefaultMountPath is where PodContainer.HostDir is mounted by default.
const DefaultMountPath = "/run/vm"

// PodContainer describes a container of a pod, as the kubelet would create
// it. Zero fields take defaults.
type PodContainer struct {
	PodUID       string // required
	Name         string // the container's name in the pod; "qemu" by default
	PodName      string // "vm" by default
	PodNamespace string // "default" by default

	// HostDir is bind-mounted (rbind, rw) at MountPath, like a volume. A new
	// t.TempDir() by default; "-" for no such mount.
	HostDir   string
	MountPath string // DefaultMountPath by default

	Image  client.Image // the busybox image by default
	Args   []string     // the image's command by default (busybox: sleep 3600)
	Mounts []specs.Mount
	// SpecOpts are applied after everything else (user, read-only root,
	// capabilities, seccomp...).
	SpecOpts []oci.SpecOpts
	Labels   map[string]string // added to the kubelet's labels

	// Stdout and Stderr receive the task's output; discarded when nil.
	Stdout, Stderr io.Writer
	// NoStart creates the container and its task without starting it.
	NoStart bool
}

// Container is a container created by the harness, with its task.
type Container struct {
	ID        string
	Labels    map[string]string
	HostDir   string // "" when there is no HostDir mount
	Container client.Container
	Task      client.Task

	opts   PodContainer
	exit   <-chan client.ExitStatus
	status *client.ExitStatus // once received from exit
}

// NewID returns a random container ID in the form CRI uses (64 hex digits).
func NewID() string {
	b := make([]byte, 32)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// NewPodUID returns a random pod UID in the form the API server gives.
func NewPodUID() string {
	b := make([]byte, 16)
	rand.Read(b)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b)
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// Create creates a container for opts with a new ID and starts its task.
// It is removed on cleanup if the test has not deleted it.
func (d *Daemon) Create(t testing.TB, opts PodContainer) *Container {
	t.Helper()
	if opts.PodUID == "" {
		t.Fatal("containerd: PodContainer.PodUID is required")
	}
	if opts.Name == "" {
		opts.Name = "qemu"
	}
	if opts.PodName == "" {
		opts.PodName = "vm"
	}
	if opts.PodNamespace == "" {
		opts.PodNamespace = "default"
	}
	if opts.MountPath == "" {
		opts.MountPath = DefaultMountPath
	}
	if opts.HostDir == "" {
		opts.HostDir = t.TempDir()
	}
	if opts.Image == nil {
		opts.Image = d.BusyboxImage(t)
	}
	c, err := d.create(t, opts)
	if err != nil {
		t.Fatalf("containerd: creating container of pod %s: %v\n%s", opts.PodUID, err, d.logTail())
	}
	return c
}

func (d *Daemon) create(t testing.TB, opts PodContainer) (*Container, error) {
	ctx, cancel := context.WithTimeout(d.Context(context.Background()), 30*time.Second)
	defer cancel()
	id := NewID()
	labels := map[string]string{
		LabelPodUID:        opts.PodUID,
		LabelPodName:       opts.PodName,
		LabelPodNamespace:  opts.PodNamespace,
		LabelContainerName: opts.Name,
		LabelKind:          "container",
	}
	maps.Copy(labels, opts.Labels)

	mounts := append([]specs.Mount(nil), opts.Mounts...)
	hostDir := ""
	if opts.HostDir != "-" {
		hostDir = opts.HostDir
		mounts = append(mounts, specs.Mount{
			Destination: opts.MountPath, Type: "bind", Source: hostDir,
			Options: []string{"rbind", "rprivate", "rw"},
		})
	}
	specOpts := []oci.SpecOpts{oci.WithImageConfig(opts.Image)}
	if len(opts.Args) > 0 {
		specOpts = append(specOpts, oci.WithProcessArgs(opts.Args...))
	}
	specOpts = append(specOpts, oci.WithMounts(mounts))
	specOpts = append(specOpts, opts.SpecOpts...)

	cont, err := d.Client.NewContainer(ctx, id,
		client.WithImage(opts.Image),
		client.WithSnapshotter(Snapshotter),
		client.WithNewSnapshot(id, opts.Image),
		client.WithNewSpec(specOpts...),
		client.WithContainerLabels(labels),
		// runc keeps its state under the daemon's directory, not in the
		// host's /run/containerd/runc, so that cleanup can find it.
		client.WithRuntime("io.containerd.runc.v2", &options.Options{Root: d.runcRoot, BinaryName: d.runcBin}),
	)
	if err != nil {
		return nil, err
	}
	c := &Container{ID: id, Labels: labels, HostDir: hostDir, Container: cont, opts: opts}
	d.track(c)

	creator := cio.NullIO
	if opts.Stdout != nil || opts.Stderr != nil {
		stdout, stderr := opts.Stdout, opts.Stderr
		if stdout == nil {
			stdout = io.Discard
		}
		if stderr == nil {
			stderr = io.Discard
		}
		// The two streams are copied by two goroutines: serialize them, so
		// that one writer can take both.
		mu := new(sync.Mutex)
		creator = cio.NewCreator(cio.WithStreams(nil, &lockedWriter{mu, stdout}, &lockedWriter{mu, stderr}), cio.WithFIFODir(d.fifoDir))
	}
	task, err := cont.NewTask(ctx, creator)
	if err != nil {
		return c, fmt.Errorf("new task: %w", err)
	}
	c.Task = task
	// Wait must be called before Start: an exit in between is not lost.
	exit, err := task.Wait(d.Context(context.Background()))
	if err != nil {
		return c, fmt.Errorf("wait: %w", err)
	}
	c.exit = exit
	if !opts.NoStart {
		if err := task.Start(ctx); err != nil {
			return c, fmt.Errorf("start: %w", err)
		}
	}
	return c, nil
}

func (d *Daemon) track(c *Container) {
	d.mu.Lock()
	d.containers[c.ID] = c
	d.mu.Unlock()
}

// Delete kills the container's task and deletes the task, the container and
// its snapshot, as the kubelet does when a pod goes away.
func (d *Daemon) Delete(t testing.TB, c *Container) {
	t.Helper()
	ctx, cancel := context.WithTimeout(d.Context(context.Background()), 30*time.Second)
	defer cancel()
	if err := d.remove(ctx, c); err != nil {
		t.Fatalf("containerd: deleting container %s: %v", c.ID, err)
	}
}

func (d *Daemon) remove(ctx context.Context, c *Container) error {
	ctx = d.Context(ctx)
	if c.Task != nil {
		if err := c.Task.Kill(ctx, syscall.SIGKILL); err != nil && !errdefs.IsNotFound(err) && !errdefs.IsFailedPrecondition(err) {
			// An exited task refuses the signal; anything else is worth
			// reporting, but deletion is still attempted.
			_ = err
		}
		if c.exit != nil {
			if _, err := c.Wait(ctx); err != nil {
				return fmt.Errorf("after SIGKILL: %w", err)
			}
		}
		if _, err := c.Task.Delete(ctx); err != nil && !errdefs.IsNotFound(err) {
			return fmt.Errorf("delete task: %w", err)
		}
	}
	if err := c.Container.Delete(ctx, client.WithSnapshotCleanup); err != nil && !errdefs.IsNotFound(err) {
		return fmt.Errorf("delete container: %w", err)
	}
	d.mu.Lock()
	delete(d.containers, c.ID)
	d.mu.Unlock()
	return nil
}

// Replace deletes c and creates a new container with a new ID, the same
// labels and the same host directory: what happens to a pod's container
// when it is recreated. (The kubelet would start the new container before
// removing the old one; the order here is the harder case for a watcher:
// the old container is gone before the new one exists.)
func (d *Daemon) Replace(t testing.TB, c *Container) *Container {
	t.Helper()
	d.Delete(t, c)
	opts := c.opts
	if c.HostDir == "" {
		opts.HostDir = "-"
	}
	n, err := d.create(t, opts)
	if err != nil {
		t.Fatalf("containerd: recreating container of pod %s: %v", opts.PodUID, err)
	}
	return n
}

// Kill sends SIGKILL to the container's task and waits for it to exit, but
// deletes neither: the container stays, stopped, as after a crash.
func (d *Daemon) Kill(t testing.TB, c *Container) {
	t.Helper()
	ctx, cancel := context.WithTimeout(d.Context(context.Background()), 30*time.Second)
	defer cancel()
	if err := c.Task.Kill(ctx, syscall.SIGKILL); err != nil {
		t.Fatalf("containerd: kill %s: %v", c.ID, err)
	}
	if _, err := c.Wait(ctx); err != nil {
		t.Fatal(err)
	}
}

// Wait waits for the container's task to exit and returns its exit status.
// A wait cut short by containerd going away (Restart) is resumed.
func (c *Container) Wait(ctx context.Context) (uint32, error) {
	if c.exit == nil {
		return 0, errors.New("container has no task")
	}
	for c.status == nil {
		select {
		case st := <-c.exit:
			if st.Error() == nil {
				c.status = &st
				break
			}
			// The stream broke: wait again, on a new one, after a pause
			// (containerd may still be coming back).
			select {
			case <-time.After(100 * time.Millisecond):
			case <-ctx.Done():
				return 0, fmt.Errorf("task %s: %w (after %v)", c.ID, ctx.Err(), st.Error())
			}
			exit, err := c.Task.Wait(ctx)
			if err != nil {
				if ctx.Err() != nil {
					return 0, fmt.Errorf("task %s: %w", c.ID, err)
				}
				ch := make(chan client.ExitStatus, 1)
				ch <- st // try again
				exit = ch
			}
			c.exit = exit
		case <-ctx.Done():
			return 0, fmt.Errorf("task %s still running: %w", c.ID, ctx.Err())
		}
	}
	code, _, err := c.status.Result()
	return code, err
}

// Run creates a container for opts, starts it, waits up to timeout for it
// to exit, deletes it and returns its exit status. Its output goes to
// opts.Stdout and opts.Stderr.
func (d *Daemon) Run(t testing.TB, opts PodContainer, timeout time.Duration) uint32 {
	t.Helper()
	if opts.PodUID == "" {
		opts.PodUID = NewPodUID()
	}
	if opts.HostDir == "" {
		opts.HostDir = "-"
	}
	c := d.Create(t, opts)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	code, err := c.Wait(ctx)
	if err != nil {
		t.Errorf("containerd: %v", err)
	}
	d.Delete(t, c) // waits for the output to be copied

	return code
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
