package mounter

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/beneath"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Config is the mounter's configuration: everything it may touch is named
// here, never in a request.
type Config struct {
	// Socket is the unix socket the agent connects to; its directory must
	// be root's alone (0700).
	Socket string
	// PodsDir is the kubelet's pods directory: every target is below it.
	PodsDir string
	// PublicationRoots are the directories the agent prepares publications
	// in (the node FUSE mount, the RAM cache): every source is below one.
	PublicationRoots []string
	// AgentGID, when not negative, is the gid the agent runs with: a peer
	// must have it as well as uid 0.
	AgentGID int
	// Log receives refusals and failures (nil: discarded).
	Log *slog.Logger
}

// DefaultPodsDir is the kubelet's pods directory on a default install.
const DefaultPodsDir = "/var/lib/kubelet/pods"

// Bounds on what callers can make the mounter hold.
const (
	maxConns    = 16              // connections served at once; more wait in the backlog
	idleTimeout = 2 * time.Minute // a connection with no request for this long is closed
	// shutdownGrace bounds the wait for requests in flight when the
	// mounter stops.
	shutdownGrace = 10 * time.Second
	// refusalTimeout bounds the wait for a refused caller's request.
	refusalTimeout = 5 * time.Second
)

// Server is a running mounter.
type Server struct {
	cfg   Config
	pods  *os.File // O_PATH, opened once: targets resolve beneath it
	ln    *net.UnixListener
	fuse  fdStore
	locks keyedMutex
	slots chan struct{}
	log   *slog.Logger

	shutdownGrace time.Duration

	// afterTargetOpen, if set, runs between opening a target and mounting
	// onto it: tests swap names there to show that the mount follows the
	// descriptor.
	afterTargetOpen func()
}

// New checks cfg, opens the pods directory and listens on the socket.
func New(cfg Config) (*Server, error) {
	if cfg.PodsDir == "" {
		cfg.PodsDir = DefaultPodsDir
	}
	if err := checkConfig(&cfg); err != nil {
		return nil, err
	}
	pods, err := beneath.Dir(cfg.PodsDir)
	if err != nil {
		return nil, errcode.Wrap(errcode.Usage, err, "opening the kubelet pods directory (--kubelet-pods-dir)")
	}
	ln, err := listen(cfg.Socket)
	if err != nil {
		pods.Close()
		return nil, err
	}
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Server{cfg: cfg, pods: pods, ln: ln, slots: make(chan struct{}, maxConns), log: log, shutdownGrace: shutdownGrace}, nil
}

// checkConfig requires absolute, clean paths, and at least one publication
// root.
func checkConfig(cfg *Config) error {
	paths := append([]string{cfg.Socket, cfg.PodsDir}, cfg.PublicationRoots...)
	for _, p := range paths {
		if p == "" || !filepath.IsAbs(p) || filepath.Clean(p) != p || p == "/" {
			return errcode.New(errcode.Usage, "the mounter needs absolute, clean paths other than /; %q is not", p)
		}
	}
	if len(cfg.PublicationRoots) == 0 {
		return errcode.New(errcode.Usage, "the mounter needs at least one publication root (--publication-root)")
	}
	return nil
}

// Serve answers requests until ctx ends, then closes the socket and lets
// go of the held /dev/fuse descriptor.
func (s *Server) Serve(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() { s.ln.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer s.close(&wg)
	for {
		select {
		case s.slots <- struct{}{}:
		case <-ctx.Done(): // every slot held by a request that does not end
			return nil
		}
		c, err := s.ln.AcceptUnix()
		if err != nil {
			<-s.slots
			if ctx.Err() != nil {
				return nil
			}
			return errcode.Wrap(errcode.Internal, err, "accepting on the mounter's socket")
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-s.slots }()
			s.serveConn(ctx, c)
		}()
	}
}

// close stops serving. A request blocked in the kernel (a lookup on a
// FUSE server that does not answer) cannot be cancelled: after
// shutdownGrace the mounter goes without it, leaving open what it may
// still use.
func (s *Server) close(wg *sync.WaitGroup) {
	s.ln.Close()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		s.pods.Close()
		s.fuse.close()
	case <-time.After(s.shutdownGrace):
		s.log.Warn("stopping with requests still blocked in the kernel (a FUSE server that does not answer?)")
	}
}

// serveConn answers one connection's requests, one at a time.
func (s *Server) serveConn(ctx context.Context, c *net.UnixConn) {
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	if err := s.admit(c); err != nil {
		s.refuse(c, err)
		return
	}
	for {
		c.SetReadDeadline(time.Now().Add(idleTimeout))
		var req request
		f, err := recv(c, &req)
		if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || errors.Is(err, os.ErrDeadlineExceeded) {
			return
		}
		if err != nil {
			s.reply(c, err, nil) // a malformed message ends the connection
			return
		}
		var out *os.File
		err = errcode.Safely(func() (err error) {
			out, err = s.handle(req, f)
			return err
		})
		if !s.reply(c, err, out) {
			return
		}
	}
}

// refuse answers a caller that may not use the mounter: after its first
// request (bounded in size and time; closing at once would leave it with
// a broken pipe rather than the reason) with the refusal.
func (s *Server) refuse(c *net.UnixConn, why error) {
	s.log.Warn("refused a caller on the mounter socket", "err", why)
	c.SetReadDeadline(time.Now().Add(refusalTimeout))
	var req request
	if f, err := recv(c, &req); f != nil {
		f.Close()
	} else if errors.Is(err, io.EOF) || errors.Is(err, os.ErrDeadlineExceeded) {
		return
	}
	s.reply(c, why, nil)
}

// reply sends err (nil: success) and, on success, f; it closes f. It
// reports whether the answer went out.
func (s *Server) reply(c *net.UnixConn, err error, f *os.File) bool {
	resp := response{Version: Version}
	if err != nil {
		// Messages quote the request's paths: cut to fit one message.
		e := api.ErrorOf(err).Truncated(MaxMessage - 64)
		resp.Error = &e
	}
	if f != nil {
		defer f.Close()
	}
	if err := send(c, resp, f); err != nil {
		s.log.Warn("could not answer on the mounter socket", "err", err)
		return false
	}
	return true
}
