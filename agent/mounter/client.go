package mounter

import (
	"context"
	"net"
	"os"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Client is the agent's side: each call is one connection, one request and
// one response. Errors the mounter returns keep their code.
type Client struct {
	// Socket is the mounter's socket.
	Socket string
}

// Publish asks the mounter to mount r.Source onto r.Target.
func (c Client) Publish(ctx context.Context, r PublishRequest) error {
	_, err := c.call(ctx, request{Op: opPublish, Publish: &r}, nil)
	return err
}

// Unpublish asks the mounter to unmount and remove r.Target.
func (c Client) Unpublish(ctx context.Context, r UnpublishRequest) error {
	_, err := c.call(ctx, request{Op: opUnpublish, Unpublish: &r}, nil)
	return err
}

// PutFUSE hands the mounter a duplicate of f, the node's /dev/fuse
// descriptor, to keep. The caller keeps f.
func (c Client) PutFUSE(ctx context.Context, f *os.File) error {
	_, err := c.call(ctx, request{Op: opPutFUSE}, f)
	return err
}

// GetFUSE returns a duplicate of the /dev/fuse descriptor the mounter
// holds, or nil if it holds none.
func (c Client) GetFUSE(ctx context.Context) (*os.File, error) {
	return c.call(ctx, request{Op: opGetFUSE}, nil)
}

func (c Client) call(ctx context.Context, req request, f *os.File) (*os.File, error) {
	req.Version = Version
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unixpacket", c.Socket)
	if err != nil {
		return nil, errcode.Wrap(errcode.Internal, err, "connecting to the mounter (is the vmsnap node DaemonSet running on this node?)")
	}
	defer conn.Close()
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		return nil, errcode.New(errcode.Internal, "the mounter's socket gave a %T, not a unix connection", conn)
	}
	stop := context.AfterFunc(ctx, func() { uc.Close() })
	defer stop()
	if err := send(uc, req, f); err != nil {
		return nil, c.failed(ctx, err, "sending to")
	}
	var resp response
	got, err := recv(uc, &resp)
	if err != nil {
		return nil, c.failed(ctx, err, "reading the answer of")
	}
	switch {
	case resp.Error != nil:
		err = resp.Error
	case resp.Version != Version:
		err = versionError(resp.Version)
	default:
		return got, nil
	}
	if got != nil {
		got.Close()
	}
	return nil, err
}

// failed is an error of the exchange: the context's when it ended it.
func (c Client) failed(ctx context.Context, err error, what string) error {
	if ctx.Err() != nil {
		err = ctx.Err()
	}
	return errcode.Ensure(errcode.Internal, err, "%s the mounter", what)
}
