package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Client talks to a node agent over its unix socket: what a Job uses.
type Client struct {
	http   *http.Client
	socket string
}

// NewClient connects to an agent address: unix:///PATH, or a plain path.
func NewClient(addr string) (*Client, error) {
	path := addr
	if strings.Contains(addr, "://") {
		u, err := url.Parse(addr)
		if err != nil || u.Scheme != "unix" || u.Path == "" {
			return nil, errcode.New(errcode.Usage, "agent address %q: use unix:///PATH/TO/agent.sock", addr)
		}
		path = u.Path
	}
	dial := func(ctx context.Context, _, _ string) (net.Conn, error) { return dialAgent(ctx, path) }
	return &Client{socket: path, http: &http.Client{Transport: &http.Transport{DialContext: dial, MaxIdleConns: 4}}}, nil
}

// dialAgent connects to the agent's socket. A full listen queue (EAGAIN:
// the agent is accepting more connections than it can place, another
// caller's flood) is waited out for a while rather than reported as an
// agent that does not answer.
func dialAgent(ctx context.Context, path string) (net.Conn, error) {
	var d net.Dialer
	wait := 10 * time.Millisecond
	for deadline := time.Now().Add(dialPatience); ; wait = min(2*wait, time.Second) {
		c, err := d.DialContext(ctx, "unix", path)
		if err == nil || !errors.Is(err, syscall.EAGAIN) || time.Now().After(deadline) {
			return c, err
		}
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return nil, err
		}
	}
}

// dialPatience is how long dialAgent waits out a full listen queue.
const dialPatience = 30 * time.Second

func (c *Client) do(ctx context.Context, method, path string, body, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return errcode.Wrap(errcode.Internal, err, "encoding the request")
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://agent"+path, rd)
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "building the request")
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return c.unreachable(err)
	}
	defer resp.Body.Close()
	return decodeResponse(resp, out)
}

func (c *Client) unreachable(err error) error {
	if ue, ok := err.(*url.Error); ok {
		err = ue.Err
	}
	return errcode.Wrap(errcode.Internal, err, "the vmsnap agent at %s does not answer (is the DaemonSet running on this node, and is the socket mounted?)", c.socket)
}

func decodeResponse(resp *http.Response, out any) error {
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "reading the agent's answer")
	}
	if resp.StatusCode >= 300 {
		var doc api.ErrorDoc
		if json.Unmarshal(b, &doc) == nil && doc.Error.Code != "" {
			return &doc.Error
		}
		return errcode.New(errcode.Internal, "the agent answered %s: %s", resp.Status, bytes.TrimSpace(b))
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(b, out); err != nil {
		return errcode.Wrap(errcode.Internal, err, "decoding the agent's answer")
	}
	return nil
}

// Checkpoint starts a checkpoint.
func (c *Client) Checkpoint(ctx context.Context, req api.CheckpointRequest) (api.Operation, error) {
	var o api.Operation
	return o, c.do(ctx, http.MethodPost, "/v1/checkpoints", req, &o)
}

// Restore starts a restore.
func (c *Client) Restore(ctx context.Context, req api.RestoreRequest) (api.Operation, error) {
	var o api.Operation
	return o, c.do(ctx, http.MethodPost, "/v1/restores", req, &o)
}

// Prepare starts a prepare: an operation that readies a memory-file
// image's RAM file in the agent's cache of the caller's namespace; its
// result (Operation.Prepare) holds the QEMU arguments that map it.
func (c *Client) Prepare(ctx context.Context, req api.PrepareRequest) (api.Operation, error) {
	var o api.Operation
	return o, c.do(ctx, http.MethodPost, "/v1/prepares", req, &o)
}

// Get returns an operation.
func (c *Client) Get(ctx context.Context, id string) (api.Operation, error) {
	var o api.Operation
	return o, c.do(ctx, http.MethodGet, "/v1/operations/"+url.PathEscape(id), nil, &o)
}

// Cancel cancels an operation.
func (c *Client) Cancel(ctx context.Context, id string) (api.Operation, error) {
	var o api.Operation
	return o, c.do(ctx, http.MethodDelete, "/v1/operations/"+url.PathEscape(id), nil, &o)
}

// List returns the operations the agent knows.
func (c *Client) List(ctx context.Context) ([]api.Operation, error) {
	var out struct{ Operations []api.Operation }
	return out.Operations, c.do(ctx, http.MethodGet, "/v1/operations", nil, &out)
}

// Health checks that the agent answers.
func (c *Client) Health(ctx context.Context) error {
	return c.do(ctx, http.MethodGet, "/healthz", nil, nil)
}

// Wait follows an operation until it ends and returns its final state,
// calling update for every change. It reads the event stream and falls back
// to polling if the stream ends early. If ctx ends first (the Job is being
// killed) the operation is cancelled, so that the VM is put back.
func (c *Client) Wait(ctx context.Context, id string, update func(api.Operation)) (api.Operation, error) {
	for {
		o, err := c.follow(ctx, id, update)
		if err == nil && o.Done() {
			return o, nil
		}
		if ctx.Err() != nil {
			return c.stopped(ctx, id, o)
		}
		if verdict(err) {
			return o, err
		}
		// The stream broke off, or the agent refused it (this caller holds
		// its streams already): poll once, then follow again.
		select {
		case <-time.After(500 * time.Millisecond):
		case <-ctx.Done():
			continue
		}
		if o, err := c.Get(ctx, id); err == nil && o.Done() {
			return o, nil
		} else if verdict(err) {
			return o, err
		}
	}
}

// verdict reports whether err settles what Wait can learn (the VM is
// gone, the caller is refused, the operation is unknown): asking again
// cannot change it. A broken connection (INTERNAL) and a caller at its
// limits (BUSY: it holds as many streams or connections as the agent
// allows) can.
func verdict(err error) bool {
	return err != nil && errcode.Has(err) && errcode.Of(err) != errcode.Internal && errcode.Of(err) != errcode.Busy
}

// stopped cancels an operation the caller stopped waiting for, and waits a
// little for its end: the agent's own error says what the operation was
// doing when it was stopped (a registry that did not answer is
// REGISTRY_ERROR, not a bare deadline) and that the VM runs again. The
// caller's reason stays in the chain.
func (c *Client) stopped(ctx context.Context, id string, last api.Operation) (api.Operation, error) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	_, _ = c.Cancel(cctx, id)
	for {
		if o, err := c.Get(cctx, id); err == nil && o.Done() {
			if o.Error == nil {
				return o, nil // it finished after all
			}
			return o, &errcode.Error{Code: o.Error.Code, Msg: o.Error.Message, Details: o.Error.Details, Err: context.Cause(ctx)}
		}
		select {
		case <-cctx.Done():
			return last, context.Cause(ctx)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (c *Client) follow(ctx context.Context, id string, update func(api.Operation)) (api.Operation, error) {
	var last api.Operation
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent/v1/events?operation="+url.QueryEscape(id), nil)
	if err != nil {
		return last, errcode.Wrap(errcode.Internal, err, "building the request")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return last, c.unreachable(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return last, decodeResponse(resp, nil)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		line := sc.Text()
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			continue
		}
		var ev api.Event
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			return last, errcode.Wrap(errcode.Internal, err, "decoding an agent event")
		}
		last = ev.Operation
		if update != nil {
			update(last)
		}
		if last.Done() {
			return last, nil
		}
	}
	if err := sc.Err(); err != nil && ctx.Err() == nil {
		return last, errcode.Wrap(errcode.Internal, err, "reading the agent's events")
	}
	return last, fmt.Errorf("event stream ended")
}

// Result turns a finished operation into the result or the error it carries.
func Result(o api.Operation) error {
	switch o.State {
	case api.StateSucceeded:
		return nil
	case api.StateFailed, api.StateCancelled:
		if o.Error != nil {
			return o.Error
		}
	}
	return errcode.New(errcode.Internal, "operation %s ended as %q without an error", o.ID, o.State)
}
