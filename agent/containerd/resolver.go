// Package containerd finds the QEMU of a Kubernetes pod on this node through
// the node's containerd: it implements agent.Resolver.
//
// A VM is named the way a controller knows it: the pod by UID, the QEMU
// container by name, and the QMP socket and disk overlay by their paths
// inside that container. Resolve finds the container the kubelet's CRI
// plugin labelled io.kubernetes.pod.uid=UID and
// io.kubernetes.container.name=NAME (never by pod name: a pod recreated
// under the same name is another VM), takes the one whose task is running,
// and maps the paths to host paths through the bind mounts (the pod's
// volumes) of its OCI spec, or, for a disk on none of them, through the
// snapshot that holds the container's writable layer. There it opens each
// file once, below the mount's source, without following any link (see
// openBelow), and hands the agent the descriptors to use. Watch reports
// containers that are deleted or whose main process exited, so that the
// agent can drop every record about them at once.
//
// It talks to containerd only through its gRPC API with the
// github.com/containerd/containerd/v2 client, which also works against
// containerd 1.6 and 1.7. It never enters the container's namespaces and
// never execs into it.
package containerd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path"
	"slices"
	"strings"
	"sync"
	"time"

	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	tasktypes "github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"golang.org/x/sys/unix"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/internal/beneath"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
)

const (
	// DefaultAddress is containerd's usual gRPC socket on a node.
	DefaultAddress = "/run/containerd/containerd.sock"
	// DefaultNamespace is the containerd namespace of the kubelet's CRI
	// plugin.
	DefaultNamespace = "k8s.io"

	// The labels the CRI plugin puts on every container of a pod.
	LabelPodUID        = "io.kubernetes.pod.uid"
	LabelContainerName = "io.kubernetes.container.name"
	LabelPodNamespace  = "io.kubernetes.pod.namespace"
	LabelPodName       = "io.kubernetes.pod.name"
	// LabelKind is "sandbox" on a pod's pause container, which is skipped.
	LabelKind = "io.cri-containerd.kind"
)

// Resolver is an agent.Resolver backed by a containerd. It is safe for
// concurrent use.
type Resolver struct {
	client    *client.Client
	namespace string
	log       *slog.Logger
	retryMax  time.Duration
	podsDir   string // see WithPodsDir; "" for no such check

	mu sync.Mutex
	// known holds the identity of each container Resolve returned, by
	// container ID, until containerd reports it deleted: a deleted
	// container's labels cannot be asked for any more.
	known map[string]agent.Gone
}

var _ agent.Resolver = (*Resolver)(nil)

// Option configures a Resolver.
type Option func(*Resolver)

// WithLogger sets the logger (slog.Default() otherwise). The resolver logs
// only trouble with the event stream, at warning level.
func WithLogger(l *slog.Logger) Option { return func(r *Resolver) { r.log = l } }

// WithPodsDir makes the resolver open a VM's files only on volumes whose
// host directory is the kubelet's own, of that very pod: below
// DIR/POD_UID/ (emptyDir, configMap, CSI and persistent volumes, subPaths:
// every volume the kubelet sets up is there). A volume whose source is
// anywhere else is a hostPath (or a runtime mount), which the pod's
// author chose: through it a tenant could make the agent, root on the
// node, open another pod's QMP socket or any file of the node as its
// VM's. DIR is the kubelet's pods directory, /var/lib/kubelet/pods on most
// nodes, as the agent sees it.
func WithPodsDir(dir string) Option { return func(r *Resolver) { r.podsDir = path.Clean(dir) } }

// WithRetryMax bounds the wait between attempts to subscribe again to
// containerd's events after the stream failed (5s by default).
func WithRetryMax(d time.Duration) Option { return func(r *Resolver) { r.retryMax = d } }

// New connects to the containerd at address (DefaultAddress when empty) and
// checks that it answers within ctx (10s at most when ctx has no deadline).
// namespace is the containerd namespace to look in; DefaultNamespace
// ("k8s.io") when empty.
func New(ctx context.Context, address, namespace string, opts ...Option) (*Resolver, error) {
	if address == "" {
		address = DefaultAddress
	}
	if namespace == "" {
		namespace = DefaultNamespace
	}
	r := &Resolver{namespace: namespace, log: slog.Default(), retryMax: 5 * time.Second, known: map[string]agent.Gone{}}
	for _, o := range opts {
		o(r)
	}
	// A missing socket is a deployment error worth saying at once: the
	// client would retry it until ctx ends.
	if sock, ok := strings.CutPrefix(address, "unix://"); ok || strings.HasPrefix(address, "/") {
		if !ok {
			sock = address
		}
		if _, err := os.Stat(sock); err != nil {
			return nil, errcode.Wrap(errcode.Internal, err, "no containerd socket at %s (on a node it is %s; an agent in a pod needs it mounted)", sock, DefaultAddress)
		}
	}
	c, err := client.New(address, client.WithDefaultNamespace(namespace), client.WithTimeout(5*time.Second))
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "containerd at %s", address)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
	}
	if _, err := c.Version(ctx); err != nil {
		c.Close()
		return nil, errcode.Wrap(errcode.Internal, err, "containerd at %s does not answer", address)
	}
	r.client = c
	return r, nil
}

// Close closes the connection to containerd. Watch channels close when
// their contexts end, not here.
func (r *Resolver) Close() error { return r.client.Close() }

// Namespace is the containerd namespace the resolver looks in.
func (r *Resolver) Namespace() string { return r.namespace }

// Resolve finds the running container of ref's pod, maps ref's paths to
// host paths and opens them (see hostPath): the caller owns the returned
// descriptors and uses them, not the paths, which are for display. The QMP
// socket must be on a volume. A disk on none of the
// container's mounts is in its writable layer: it maps to the file in the
// snapshot containerd keeps that layer in, and Target.DiskInRootfs says so.
// Errors carry a code:
//   - VM_NOT_FOUND: an empty pod UID (at once, without asking containerd);
//     no container of that pod, or none with that name, or none of them
//     running; the QMP socket or disk not there.
//   - INVALID_INPUT: a malformed pod UID or container name; a path that is
//     relative, has a ".." component, is on a mount that is not a bind
//     mount (a volume), or goes through a symbolic link or a mount point
//     inside the volume or the writable layer; a QMP path on no mount, or
//     that is not a socket; a
//     disk that is not a regular file, or in a writable layer vmsnap cannot
//     read from the host (a snapshotter other than overlayfs or native).
//   - INTERNAL: containerd failed; the kernel lacks openat2 (Linux 5.6+).
func (r *Resolver) Resolve(ctx context.Context, ref agent.VMRef) (*agent.Resolved, error) {
	if ref.PodUID == "" {
		return nil, errcode.New(errcode.VMNotFound, "no VM: the request names no pod UID (a VM is named by its pod's UID, never by pod name)")
	}
	if !validPodUID(ref.PodUID) {
		return nil, errcode.New(errcode.InvalidInput, "pod UID %q is malformed: want a UUID such as 3f2c1a9e-8b7d-4c6e-9f10-2a3b4c5d6e7f", clip(ref.PodUID))
	}
	if ref.Container == "" {
		return nil, errcode.New(errcode.InvalidInput, "no container name: name the QEMU container of pod %s", ref.PodUID)
	}
	if !validContainerName(ref.Container) {
		return nil, errcode.New(errcode.InvalidInput, "container name %q is malformed: want a DNS label such as \"qemu\"", clip(ref.Container))
	}
	if ref.QMPPath == "" {
		return nil, errcode.New(errcode.InvalidInput, "no QMP socket path: give the path of QEMU's QMP socket as seen inside container %q", ref.Container)
	}
	qmpIn, err := containerPath("QMP socket", ref.QMPPath)
	if err != nil {
		return nil, err
	}
	var diskIn string
	if ref.DiskPath != "" {
		if diskIn, err = containerPath("disk", ref.DiskPath); err != nil {
			return nil, err
		}
	}

	ctx = namespaces.WithNamespace(ctx, r.namespace)
	c, err := r.find(ctx, ref.PodUID, ref.Container)
	if err != nil {
		return nil, err
	}
	// Map no path of a VM the caller may not touch (see agent.CheckCaller).
	if err := agent.CheckCaller(ctx, c.Labels[LabelPodNamespace]); err != nil {
		return nil, err
	}
	var spec specs.Spec
	if c.Spec == nil {
		return nil, errcode.New(errcode.Internal, "container %s has no OCI spec", c.ID)
	}
	if err := json.Unmarshal(c.Spec.GetValue(), &spec); err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "container %s: reading its OCI spec", c.ID)
	}
	t := agent.Target{PodUID: ref.PodUID, Container: ref.Container, ContainerID: c.ID, Namespace: c.Labels[LabelPodNamespace]}
	var h snapshot.Handles
	podDir := ""
	if r.podsDir != "" {
		podDir = path.Join(r.podsDir, ref.PodUID)
	}
	if t.QMPPath, h.QMP, err = hostPath(spec.Mounts, podDir, "QMP socket", qmpIn, fs.ModeSocket); err != nil {
		return nil, err
	}
	if diskIn != "" {
		t.DiskPath, h.Disk, err = hostPath(spec.Mounts, podDir, "disk", diskIn, 0)
		var notOnMount *notOnMountError
		if errors.As(err, &notOnMount) {
			// Not on any mount: in the container's own writable layer.
			t.DiskPath, h.Disk, err = r.writableLayerPath(ctx, c, diskIn)
			t.DiskInRootfs = err == nil
		}
		if err != nil {
			h.Close()
			return nil, err
		}
	}
	mounts := spec.Mounts
	h.OpenRAMFile = func(memPath string) (*os.File, error) { return openRAMFile(mounts, podDir, memPath) }
	r.mu.Lock()
	r.known[c.ID] = agent.Gone{PodUID: ref.PodUID, Container: ref.Container, ContainerID: c.ID}
	r.mu.Unlock()
	return &agent.Resolved{Target: t, Handles: h}, nil
}

// openRAMFile opens, for a memory-file checkpoint, the VM's RAM file: the
// mem-path its QEMU reports, which is a path inside the QEMU container and
// as hostile as anything the tenant's QEMU says. It is mapped and opened as
// the disk is (hostPath: a bind-mounted volume of the pod's own, below
// podDir; openat2 beneath it, no symbolic link, magic link, mount or ".."
// crossed; a regular file, opened read-only through the descriptor
// checked), but never in the container's writable layer or root
// filesystem: guest RAM belongs on a volume (an emptyDir with medium:
// Memory). The checkpoint reads what was opened, and only the VM's
// recorded memory size of it.
func openRAMFile(mounts []specs.Mount, podDir, memPath string) (*os.File, error) {
	const what = "RAM file (QEMU's mem-path)"
	if len(memPath) > 4096 {
		return nil, errcode.New(errcode.InvalidInput, "the VM's %s %q is longer than a path may be", what, clip(memPath))
	}
	in, err := containerPath(what, memPath)
	if err != nil {
		return nil, err
	}
	_, f, err := hostPath(mounts, podDir, what, in, 0)
	var notOnMount *notOnMountError
	if errors.As(err, &notOnMount) {
		return nil, errcode.New(errcode.InvalidInput,
			"the VM's %s %s is in the QEMU container's own root filesystem, not on a volume: put the RAM file on a volume of the pod (an emptyDir with medium: Memory), or checkpoint with format stream", what, in)
	}
	return f, err
}

// find returns the newest container of pod uid named name whose task runs.
func (r *Resolver) find(ctx context.Context, uid, name string) (containers.Container, error) {
	list, err := r.client.ContainerService().List(ctx, fmt.Sprintf(`labels.%q==%q`, LabelPodUID, uid))
	if err != nil {
		return containers.Container{}, errcode.Wrap(errcode.Internal, err, "asking containerd for the containers of pod %s", uid)
	}
	var names []string
	var candidates []containers.Container
	for _, c := range list {
		if c.Labels[LabelKind] == "sandbox" {
			continue
		}
		n := c.Labels[LabelContainerName]
		if n == name {
			candidates = append(candidates, c)
		} else if n != "" && !slices.Contains(names, n) {
			names = append(names, n)
		}
	}
	if len(candidates) == 0 {
		if len(names) == 0 {
			return containers.Container{}, errcode.New(errcode.VMNotFound, "no pod with UID %s on this node (containerd namespace %s): unknown pod UID, or the pod runs on another node or is gone", uid, r.namespace)
		}
		slices.Sort(names)
		return containers.Container{}, errcode.New(errcode.VMNotFound, "pod %s has no container named %q on this node (its containers: %s)", uid, name, strings.Join(names, ", "))
	}
	// After restarts the kubelet keeps exited containers of the same name
	// next to the running one: take the newest running one.
	slices.SortFunc(candidates, func(a, b containers.Container) int { return b.CreatedAt.Compare(a.CreatedAt) })
	var states []string
	for _, c := range candidates {
		resp, err := r.client.TaskService().Get(ctx, &tasksapi.GetRequest{ContainerID: c.ID})
		if err != nil {
			// The raw task service answers gRPC statuses: a pod being
			// deleted has its task gone before its container.
			if errdefs.IsNotFound(errgrpc.ToNative(err)) {
				states = append(states, shortID(c.ID)+" has no task")
				continue
			}
			return containers.Container{}, errcode.Wrap(errcode.Internal, err, "asking containerd for the task of container %s", c.ID)
		}
		if st := resp.GetProcess().GetStatus(); st != tasktypes.Status_RUNNING {
			states = append(states, shortID(c.ID)+" is "+strings.ToLower(st.String()))
			continue
		}
		return c, nil
	}
	return containers.Container{}, errcode.New(errcode.VMNotFound, "container %q of pod %s is not running (%s)", name, uid, strings.Join(states, "; "))
}

// containerPath checks a path as seen inside the container and returns it
// cleaned.
func containerPath(what, p string) (string, error) {
	if !strings.HasPrefix(p, "/") {
		return "", errcode.New(errcode.InvalidInput, "%s path %q is not absolute: give it as seen inside the container", what, clip(p))
	}
	if strings.ContainsRune(p, 0) {
		return "", errcode.New(errcode.InvalidInput, "%s path %q contains a NUL byte", what, clip(p))
	}
	if slices.Contains(strings.Split(p, "/"), "..") {
		return "", errcode.New(errcode.InvalidInput, "%s path %q has a \"..\" component: give the path without one", what, clip(p))
	}
	return path.Clean(p), nil
}

// hostPath maps p, a clean absolute path inside the container, to the host
// through the mount that p is on (the one with the longest destination
// that contains p; of equal ones the last, which is mounted on top), and
// opens it there. That mount must be a bind mount: a pod's volumes are.
// Unless podDir is "", the mount's source must be below podDir, the
// kubelet's directory of the pod (see WithPodsDir). See openBelow for how
// the path below the mount is opened and checked.
func hostPath(mounts []specs.Mount, podDir, what, p string, mode fs.FileMode) (string, *os.File, error) {
	best := -1
	for i, m := range mounts {
		d := path.Clean("/" + m.Destination)
		if !within(p, d) {
			continue
		}
		if best < 0 || len(d) >= len(path.Clean("/"+mounts[best].Destination)) {
			best = i
		}
	}
	if best < 0 {
		return "", nil, &notOnMountError{errcode.New(errcode.InvalidInput,
			"%s %s is in the container's own root filesystem, not on a volume: the %s must be on a volume "+
				"(a bind mount such as an emptyDir) shared with the node; paths in the container's root filesystem are not supported",
			what, p, what)}
	}
	m := mounts[best]
	dest := path.Clean("/" + m.Destination)
	if !isBind(m) {
		typ := m.Type
		if typ == "" {
			typ = "non-bind"
		}
		return "", nil, errcode.New(errcode.InvalidInput,
			"%s %s is on the container's %s mount at %s, not on a volume: the %s must be on a volume (a bind mount such as an emptyDir) shared with the node",
			what, p, typ, dest, what)
	}
	src := m.Source
	if !strings.HasPrefix(src, "/") || slices.Contains(strings.Split(src, "/"), "..") {
		return "", nil, errcode.New(errcode.InvalidInput, "%s %s is on a bind mount whose source %q is not a plain absolute path", what, p, src)
	}
	src = path.Clean(src)
	if podDir != "" && (src == podDir || !within(src, podDir)) {
		return "", nil, errcode.New(errcode.Forbidden,
			"%s %s is on a volume mounted at %s whose host path %s is not in the kubelet's directory of the pod (%s): a hostPath volume, or a mount of the runtime's; the agent opens a VM's files only on the pod's own volumes (emptyDir, persistent volumes, ...)",
			what, p, dest, src, podDir)
	}
	rel := strings.TrimPrefix(strings.TrimPrefix(p, dest), "/")
	return openBelow(src, rel, dest, "in the volume", what, p, mode, func(err error) error {
		return errcode.New(errcode.VMNotFound,
			"%s %s: the volume mounted at %s (host path %s) is not there as the agent sees it (%v); if the agent runs in a container, mount the kubelet's pod directory into it at the same path",
			what, p, dest, src, err)
	})
}

// openBelow opens src/rel, the host path of p (the container's path of a
// what), and returns that path (for display only) and the file: an O_PATH
// descriptor of a socket (mode fs.ModeSocket), or a regular file (mode 0)
// open for reading. src, the mount's source, is trusted and followed (the
// kubelet's or the snapshotter's directory); rel is opened below it with
// openat2, so that no symbolic link (links there are the container's to
// set, and the agent runs as root on the host), no magic link and no mount
// is crossed, and the type is checked on what was opened. Nothing is
// looked up by name again: a file swapped after this is not what the
// agent uses. dest is where src appears in the container, where names that
// place ("in the volume"); noSrc makes the error for a src that is not
// there.
func openBelow(src, rel, dest, where, what, p string, mode fs.FileMode, noSrc func(error) error) (string, *os.File, error) {
	host := path.Join(src, rel)
	if !within(host, src) {
		return "", nil, errcode.New(errcode.InvalidInput, "%s %s maps to %s, outside %s", what, p, host, src)
	}
	var f *os.File
	if rel == "" {
		// p is the mount's destination: a file bind-mounted on its own.
		var err error
		if f, err = beneath.Path(src); err != nil {
			return "", nil, noSrc(err)
		}
	} else {
		dir, err := beneath.Dir(src)
		if err != nil {
			return "", nil, noSrc(err)
		}
		f, err = beneath.Open(dir, rel, host)
		dir.Close()
		if err != nil {
			return "", nil, openError(err, where, what, p, host)
		}
	}
	f, err := checkType(f, what, p, host, mode)
	return host, f, err
}

// openError gives an error of beneath.Open its code and a message.
func openError(err error, where, what, p, host string) error {
	switch {
	case errors.Is(err, unix.ENOENT), errors.Is(err, unix.ENOTDIR):
		// A file where the path needs a directory is as absent.
		return errcode.New(errcode.VMNotFound, "no %s at %s in the container (host path %s does not exist)", what, p, host)
	case errors.Is(err, unix.ELOOP):
		return errcode.New(errcode.InvalidInput, "%s %s: its path %s goes through a symbolic link; vmsnap does not follow links inside a container", what, p, where)
	case errors.Is(err, unix.EXDEV):
		return errcode.New(errcode.InvalidInput, "%s %s: its path %s crosses a mount point; vmsnap opens files only on the volume itself", what, p, where)
	case errors.Is(err, unix.ENAMETOOLONG):
		return errcode.New(errcode.InvalidInput, "%s path %q is too long for the node's file system", what, clip(p))
	case errors.Is(err, unix.ENOSYS):
		return errcode.Wrap(errcode.Internal, err, "opening %s %s: the node's kernel lacks openat2 (Linux 5.6 or later is needed)", what, p)
	}
	return errcode.Wrap(errcode.Internal, err, "%s %s", what, p)
}

// checkType checks f's type against mode (fstat: the file opened, not its
// name) and returns f (a socket) or the regular file reopened for reading
// through f; f is closed otherwise.
func checkType(f *os.File, what, p, host string, mode fs.FileMode) (*os.File, error) {
	typ, err := beneath.Type(f)
	switch {
	case err != nil:
		f.Close()
		return nil, errcode.Wrap(errcode.Internal, err, "%s %s", what, p)
	case mode == fs.ModeSocket && typ != fs.ModeSocket:
		f.Close()
		return nil, errcode.New(errcode.InvalidInput, "%s %s (host path %s) is not a unix socket (%s)", what, p, host, beneath.TypeName(typ))
	case mode == fs.ModeSocket:
		return f, nil
	case typ != 0:
		f.Close()
		return nil, errcode.New(errcode.InvalidInput, "%s %s (host path %s) is not a regular file (%s)", what, p, host, beneath.TypeName(typ))
	}
	// Opened for I/O only now that it is known to be a regular file: a
	// FIFO would block the open, a device could act on it.
	r, err := beneath.Reopen(f)
	f.Close()
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "opening %s %s", what, p)
	}
	return r, nil
}

// notOnMountError is hostPath's error for a path on none of the
// container's mounts, which is in the container's writable layer.
type notOnMountError struct{ error }

func (e *notOnMountError) Unwrap() error { return e.error }

// writableLayerPath maps p, a clean absolute path inside container c that
// is on none of its mounts, to the file in c's writable layer, as the
// snapshotter keeps it: the overlay's upper directory (or a bind-mounted
// directory: the native snapshotter, or an overlay snapshot with no image
// layers below it), and opens it there as openBelow does. The file must be
// there: a disk overlay QEMU writes to is copied up into the upper
// directory when QEMU opens it.
//
// The agent reads the file there, to check the overlay before the VM is
// touched: if it runs in a container, containerd's root must be mounted
// into it at the same path.
func (r *Resolver) writableLayerPath(ctx context.Context, c containers.Container, p string) (string, *os.File, error) {
	if c.Snapshotter == "" || c.SnapshotKey == "" {
		return "", nil, errcode.New(errcode.InvalidInput,
			"disk %s is in the root filesystem of container %s, which has no snapshot (writable layer) in containerd: put the disk on a volume", p, shortID(c.ID))
	}
	mounts, err := r.client.SnapshotService(c.Snapshotter).Mounts(ctx, c.SnapshotKey)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return "", nil, errcode.Wrap(errcode.VMNotFound, err, "the writable layer of container %s is gone", shortID(c.ID))
		}
		return "", nil, errcode.Wrap(errcode.Internal, err, "asking containerd for the writable layer of container %s", c.ID)
	}
	root, err := upperDir(mounts)
	if err != nil {
		return "", nil, errcode.Wrap(errcode.InvalidInput, err,
			"disk %s is in the writable layer of container %s (snapshotter %s), which vmsnap cannot read from the host: put the disk on a volume", p, shortID(c.ID), c.Snapshotter)
	}
	noRoot := false
	host, f, err := openBelow(root, strings.TrimPrefix(p, "/"), "/", "in the container's writable layer", "disk", p, 0, func(err error) error {
		noRoot = true
		return errcode.New(errcode.VMNotFound,
			"disk %s: the writable layer of container %s (host path %s) is not there as the agent sees it (%v); if the agent runs in a container, mount containerd's root directory into it at the same path",
			p, shortID(c.ID), root, err)
	})
	if errcode.Of(err) == errcode.VMNotFound && !noRoot {
		return "", nil, errcode.Wrap(errcode.VMNotFound, err,
			"no disk at %s in the writable layer of container %s, nor on a volume (a disk QEMU has opened for writing is in that layer)", p, shortID(c.ID))
	}
	return host, f, err
}

// upperDir is the directory holding a writable layer, from the mounts of an
// active snapshot: an overlay's upperdir, or a bind mount's source.
func upperDir(mounts []mount.Mount) (string, error) {
	if len(mounts) != 1 {
		return "", fmt.Errorf("the snapshot is %d mounts, not one", len(mounts))
	}
	m := mounts[0]
	var dir string
	switch {
	case m.Type == "overlay":
		for _, o := range m.Options {
			if v, ok := strings.CutPrefix(o, "upperdir="); ok {
				dir = unescapeOption(v)
			}
		}
		if dir == "" {
			return "", errors.New("a read-only overlay (no upperdir)")
		}
	case isBind(specs.Mount{Type: m.Type, Options: m.Options}):
		if slices.Contains(m.Options, "ro") {
			return "", errors.New("a read-only bind mount")
		}
		dir = m.Source
	default:
		return "", fmt.Errorf("a %s mount of %s", m.Type, m.Source)
	}
	if !strings.HasPrefix(dir, "/") || slices.Contains(strings.Split(dir, "/"), "..") {
		return "", fmt.Errorf("its directory %q is not a plain absolute path", dir)
	}
	return path.Clean(dir), nil
}

// unescapeOption undoes the backslash escaping of a path in an overlay
// mount option (containerd 2 escapes ',' ':' and '\\' in them).
func unescapeOption(v string) string {
	if !strings.Contains(v, `\`) {
		return v
	}
	var b strings.Builder
	for i := 0; i < len(v); i++ {
		if v[i] == '\\' && i+1 < len(v) {
			i++
		}
		b.WriteByte(v[i])
	}
	return b.String()
}

// within reports whether p is dir or below it (both clean and absolute).
func within(p, dir string) bool {
	return p == dir || dir == "/" || strings.HasPrefix(p, dir+"/")
}

func isBind(m specs.Mount) bool {
	if m.Type == "bind" || m.Type == "rbind" {
		return true
	}
	// A mount with no type (or "none") is a bind mount if its options say so.
	if m.Type == "" || m.Type == "none" {
		return slices.Contains(m.Options, "bind") || slices.Contains(m.Options, "rbind")
	}
	return false
}

// validPodUID accepts the two forms of a pod UID: a UUID (8-4-4-4-12 hex
// digits; what the API server gives) and 32 hex digits (the kubelet's UID
// of a static pod, an MD5 of its manifest).
func validPodUID(s string) bool {
	switch len(s) {
	case 36:
		for i := 0; i < len(s); i++ {
			if i == 8 || i == 13 || i == 18 || i == 23 {
				if s[i] != '-' {
					return false
				}
			} else if !isHex(s[i]) {
				return false
			}
		}
		return true
	case 32:
		for i := 0; i < len(s); i++ {
			if !isHex(s[i]) {
				return false
			}
		}
		return true
	}
	return false
}

func isHex(c byte) bool { return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F' }

// validContainerName: a container's name in a pod is a DNS label (RFC 1123).
func validContainerName(s string) bool {
	if len(s) == 0 || len(s) > 63 || s[0] == '-' || s[len(s)-1] == '-' {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

func shortID(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

// clip shortens a caller's string for an error message.
func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "..."
	}
	return s
}
