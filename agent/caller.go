package agent

// Who is calling, and what they may do.
//
// Every API request under /v1 is made by a Caller the agent established
// from the connection's peer credentials (caller_linux.go): the pod
// namespace of the kubelet container the calling process runs in, or a
// process on the node outside any container, which is an administrator.
// A caller acts only on VMs in its own namespace, and sees and cancels only
// their operations; a caller in one of --admin-namespace, and a process on
// the node, act on every VM.
//
// Another namespace's operation is answered exactly as an operation that
// does not exist: a caller learns nothing about other tenants' operations,
// not even that they exist.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Caller is who sent a request.
type Caller struct {
	// Admin callers may act on every VM and see every operation.
	Admin bool
	// Namespace is the pod namespace of the caller's container; "" for a
	// process on the node outside any container.
	Namespace      string
	Pod, Container string // the caller's pod and container, for logs
	PID            int32
}

func (c Caller) String() string {
	if c.Namespace == "" {
		return fmt.Sprintf("a process on the node (pid %d)", c.PID)
	}
	return fmt.Sprintf("container %s of pod %s/%s (pid %d)", c.Container, c.Namespace, c.Pod, c.PID)
}

// CallerContainer is the kubelet container a calling process runs in.
type CallerContainer struct {
	ID, PodNamespace, PodName, PodUID, Name string
}

// CallerIdentifier finds the container a process runs in. A Resolver that
// implements it (agent/containerd's does) lets callers in pods use the
// agent; without one, only processes on the node can.
type CallerIdentifier interface {
	// CallerContainer returns the container, among ids (the containers
	// the process's cgroups name, innermost first), whose task has pid
	// among its processes. ok is false if none of ids is a container. A
	// container that exists but does not hold pid is FORBIDDEN: the
	// cgroup's name alone proves nothing.
	CallerContainer(ctx context.Context, pid int, ids []string) (c CallerContainer, ok bool, err error)
}

type callerKey struct{}

func withCaller(ctx context.Context, c Caller) context.Context {
	return context.WithValue(ctx, callerKey{}, c)
}

func callerFrom(ctx context.Context) (Caller, bool) {
	c, ok := ctx.Value(callerKey{}).(Caller)
	return c, ok
}

// CheckCaller returns FORBIDDEN unless the caller of the request behind ctx
// may act on a VM in pod namespace ns. A resolver calls it as soon as it
// knows the VM's namespace, so that it maps no path of a VM the caller may
// not touch; the agent checks the resolved target again. A ctx without a
// caller is the agent's own work (recovery) and passes here.
func CheckCaller(ctx context.Context, ns string) error {
	c, ok := callerFrom(ctx)
	if !ok {
		return nil
	}
	return c.mayActOn(ns)
}

func (c Caller) mayActOn(ns string) error {
	if c.Admin || (ns != "" && ns == c.Namespace) {
		return nil
	}
	return errcode.New(errcode.Forbidden,
		"%s may act only on VMs in its own namespace %s, and this VM is not in it: ask from the VM's namespace, or from one the agent names with --admin-namespace", c, c.Namespace)
}

// sees reports whether the caller may see (and cancel) an operation.
func (c Caller) sees(o api.Operation) bool {
	return c.Admin || (c.Namespace != "" && namespaceOf(o) == c.Namespace)
}

// requestCaller is the caller of a request: required, FORBIDDEN if absent.
func requestCaller(ctx context.Context) (Caller, error) {
	c, ok := callerFrom(ctx)
	if !ok {
		return Caller{}, errNoCaller
	}
	return c, nil
}

var errNoCaller = errcode.New(errcode.Forbidden, "the agent could not tell who is calling, so it refuses the call")

// connIdentity is a connection that can tell who made it (caller_linux.go).
type connIdentity interface {
	identify(ctx context.Context, s *Server) (Caller, error)
}

type connKey struct{}

// connContext makes an accepted connection reachable from its requests.
func connContext(ctx context.Context, c net.Conn) context.Context {
	if ci, ok := c.(connIdentity); ok {
		return context.WithValue(ctx, connKey{}, ci)
	}
	return ctx
}

// identified runs h with the request's caller in its context, established
// once per connection; a caller the agent cannot establish gets FORBIDDEN.
func (s *Server) identified(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if _, ok := callerFrom(r.Context()); !ok {
			ci, ok := r.Context().Value(connKey{}).(connIdentity)
			if !ok {
				writeError(w, errNoCaller)
				return
			}
			c, err := ci.identify(r.Context(), s)
			if err != nil {
				s.log.Warn("refused a caller the agent could not place", "err", err)
				writeError(w, err)
				return
			}
			r = r.WithContext(withCaller(r.Context(), c))
		}
		h(w, r)
	}
}

// visibleOp returns the operation id if the request's caller may see it;
// another namespace's operation is answered as one that does not exist.
func (s *Server) visibleOp(ctx context.Context, id string) (*op, error) {
	c, err := requestCaller(ctx)
	if err != nil {
		return nil, err
	}
	o, err := s.ops.get(id)
	if err != nil {
		// A forgotten operation's reason names its pod: only who could
		// see the operation hears it.
		var f *forgotten
		if c.Admin || errors.As(err, &f) && f.ns != "" && f.ns == c.Namespace {
			return nil, err
		}
		return nil, noOperation(id)
	}
	if !c.sees(o.snapshot()) {
		return nil, noOperation(id)
	}
	return o, nil
}

func noOperation(id string) error {
	return errcode.New(errcode.InvalidInput, "no operation %s on this node", id)
}
