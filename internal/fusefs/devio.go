package fusefs

import (
	"context"
	"errors"

	"golang.org/x/sys/unix"
)

// errStopped: the server was told to stop while it waited for a request.
var errStopped = errors.New("FUSE server stopped")

// read reads one request into buf. The descriptor is non-blocking, so it
// waits in poll, for the request or for wake (an eventfd, -1 for none) or
// ctx. ENOENT (the request was interrupted before we got it) and EINTR are
// retried; ENODEV means the connection is gone (unmounted or aborted).
func (c *Conn) read(ctx context.Context, buf []byte, wake int) (int, error) {
	for {
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		n, err := unix.Read(c.fd, buf)
		switch {
		case err == nil && n == 0: // a socket's peer closed (tests); /dev/fuse says ENODEV
			return 0, unix.ENODEV
		case err == nil:
			return n, nil
		case errors.Is(err, unix.EINTR), errors.Is(err, unix.ENOENT):
			continue
		case !errors.Is(err, unix.EAGAIN):
			return 0, err
		}
		if err := c.poll(wake, unix.POLLIN); err != nil {
			return 0, err
		}
	}
}

// poll waits until the descriptor is ready for events or wake is readable.
func (c *Conn) poll(wake int, events int16) error {
	fds := []unix.PollFd{{Fd: int32(c.fd), Events: events}, {Fd: int32(wake), Events: unix.POLLIN}}
	if wake < 0 {
		fds = fds[:1]
	}
	for {
		_, err := unix.Poll(fds, -1)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		if len(fds) > 1 && fds[1].Revents != 0 {
			return errStopped
		}
		return nil
	}
}

// write writes one whole message. ENOENT (the request is gone: interrupted,
// or the connection aborted) is the caller's to judge.
func (c *Conn) write(b []byte) error {
	for {
		_, err := unix.Write(c.fd, b)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.EAGAIN): // only a socket in tests fills up
			if err := c.poll(-1, unix.POLLOUT); err != nil {
				return err
			}
			continue
		}
		return err
	}
}

// wakeOn returns an eventfd that becomes readable when ctx is done, and a
// function that releases it.
func wakeOn(ctx context.Context) (int, func(), error) {
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return -1, nil, err
	}
	ran := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(ran)
		unix.Write(fd, []byte{1, 0, 0, 0, 0, 0, 0, 0})
	})
	return fd, func() {
		if !stop() {
			<-ran // it ran or is running: let it finish before the close
		}
		unix.Close(fd)
	}, nil
}
