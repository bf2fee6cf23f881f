package agent

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
)

// refusals answers connections the agent refuses before serving them (a
// peer it does not admit, a caller over its connection limit): a caller
// gets a coded error, not a silent disconnect that it would report as "the
// agent does not answer". Answers run off the accept loop, a bounded number
// at once; beyond that a refused connection is closed at once.
type refusals struct {
	slots chan struct{}
	log   *slog.Logger
}

const (
	maxRefusing    = 32
	refusalTimeout = 2 * time.Second
)

func newRefusals(log *slog.Logger) *refusals {
	return &refusals{slots: make(chan struct{}, maxRefusing), log: log}
}

// refuse answers c with status and err's document, then closes it.
func (r *refusals) refuse(c net.Conn, status int, err error) {
	select {
	case r.slots <- struct{}{}:
		go func() {
			defer func() { <-r.slots }()
			defer func() {
				if v := recover(); v != nil {
					_ = Recovered(r.log, v, "answering a refused caller")
				}
			}()
			answerRefused(c, status, err)
		}()
	default:
		c.Close()
	}
}

// answerRefused reads the caller's request head, answers status with err
// and closes the connection, within refusalTimeout.
func answerRefused(c net.Conn, status int, err error) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(refusalTimeout))
	// The head only, bounded: answering before the request was sent can
	// make a client see a reset instead of the answer.
	if _, err := http.ReadRequest(bufio.NewReader(io.LimitReader(c, maxHeaderBytes))); err != nil {
		return
	}
	body, _ := json.Marshal(api.ErrorDoc{Error: api.ErrorOf(err)})
	var b bytes.Buffer
	fmt.Fprintf(&b, "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		status, http.StatusText(status), len(body), body)
	if _, err := c.Write(b.Bytes()); err != nil {
		return
	}
	// Close our side of the stream, then drain what the caller still sends
	// (a request body), so that closing does not reset the connection
	// before the caller has read the answer.
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(c, maxRequestBody+1))
}
