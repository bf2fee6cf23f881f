//go:build !linux

package agent

import (
	"log/slog"
	"net"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// withPeerCheck needs Linux's SO_PEERCRED: elsewhere the agent refuses to
// serve rather than serve without checking its callers (see peercred.go).
func withPeerCheck(ln net.Listener, group string, log *slog.Logger, _ *refusals) (net.Listener, error) {
	return nil, errcode.New(errcode.Usage, "the agent checks its callers' peer credentials, which needs Linux")
}
