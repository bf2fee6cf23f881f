package agent

import (
	"context"
	"sync"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/agent/csi"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// fills are the cache fills publications wait for, one per namespace and
// image, however many publishes wait for it. A fill runs to its end (the
// operation timeout bounds it) even when every publish waiting for it has
// gone: the kubelet gives up on a publish after two minutes and retries,
// and the retry must find the fill under way, or the file, rather than
// start the fetch again.
type fills struct {
	mu sync.Mutex
	m  map[string]*fill
}

type fill struct {
	done chan struct{}
	res  *api.PrepareResult
	err  error
}

// join returns the fill of key, starting it with run if none is under way.
func (fs *fills) join(key string, run func() (*api.PrepareResult, error)) *fill {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if f, ok := fs.m[key]; ok {
		return f
	}
	if fs.m == nil {
		fs.m = map[string]*fill{}
	}
	f := &fill{done: make(chan struct{})}
	fs.m[key] = f
	go func() {
		defer close(f.done)
		defer func() {
			fs.mu.Lock()
			delete(fs.m, key)
			fs.mu.Unlock()
		}()
		f.res, f.err = run()
	}()
	return f
}

// prepare fills the pod's namespace's cache as that namespace's prepare
// would (prepareFor), joining the fill of the same image under way.
func (p *csiPublisher) prepare(ctx context.Context, pub csi.Publication) (*api.PrepareResult, error) {
	f := p.fills.join(pub.Pod.Namespace+"\x00"+pub.Image, func() (res *api.PrepareResult, err error) {
		defer func() {
			if v := recover(); v != nil {
				err = Recovered(p.s.log, v, "a CSI publication's cache fill", "image", pub.Image)
			}
		}()
		return p.s.prepareFor(context.WithoutCancel(ctx), pub)
	})
	select {
	case <-f.done:
		return f.res, f.err
	case <-ctx.Done():
		return nil, errcode.Wrap(errcode.Busy, context.Cause(ctx), "the RAM file of %s is still being fetched into namespace %s's cache: the kubelet's retry will wait for it", pub.Image, pub.Pod.Namespace)
	}
}
