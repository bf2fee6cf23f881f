// Package streamflood is a hostile caller of the node agent for tests: it
// asks for the agent's event stream again and again, each time on a new
// connection, many at once, and keeps every stream it gets. The agent's
// tests run it in a process of its own (agent) and in a container, as one
// tenant's caller (internal/testing/e2e/testdata/streamflood).
package streamflood

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Result is what the caller saw.
type Result struct {
	Streams  int      `json:"streams"`  // answered 200: streams it holds
	Busy     int      `json:"busy"`     // answered BUSY naming a limit
	Closed   int      `json:"closed"`   // closed before an answer
	DialErrs int      `json:"dialErrs"` // connect() failed
	Other    []string `json:"other"`    // any other answer (the first few)
}

// Total is the attempts the result counts.
func (r Result) Total() int { return r.Streams + r.Busy + r.Closed + r.DialErrs + len(r.Other) }

// Run makes attempts stream requests to the agent at socket, workers at a
// time, and returns what it saw and the streams it got, open: the caller
// closes them.
func Run(socket string, attempts, workers int) (Result, []net.Conn) {
	var (
		mu   sync.Mutex
		r    Result
		held []net.Conn
		next atomic.Int64
		wg   sync.WaitGroup
	)
	for range workers {
		wg.Go(func() {
			for next.Add(1) <= int64(attempts) {
				c, outcome := attempt(socket)
				mu.Lock()
				r.count(outcome)
				if c != nil {
					held = append(held, c)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return r, held
}

func (r *Result) count(outcome string) {
	switch outcome {
	case "stream":
		r.Streams++
	case "busy":
		r.Busy++
	case "closed":
		r.Closed++
	case "dial":
		r.DialErrs++
	default:
		if len(r.Other) < 5 {
			r.Other = append(r.Other, outcome)
		}
	}
}

// attempt asks for the stream on a new connection, which it returns, open,
// if it got the stream.
func attempt(socket string) (net.Conn, string) {
	c, err := net.Dial("unix", socket)
	if err != nil {
		return nil, "dial"
	}
	_ = c.SetDeadline(time.Now().Add(time.Minute))
	if _, err := io.WriteString(c, "GET /v1/events HTTP/1.1\r\nHost: agent\r\n\r\n"); err != nil {
		c.Close()
		return nil, "closed"
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		c.Close()
		return nil, "closed"
	}
	if resp.StatusCode == http.StatusOK {
		_ = c.SetDeadline(time.Time{})
		return c, "stream"
	}
	defer c.Close()
	var doc struct {
		Error struct{ Code, Message string }
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if json.Unmarshal(b, &doc) == nil && doc.Error.Code == "BUSY" && strings.Contains(doc.Error.Message, "--max-") {
		return nil, "busy"
	}
	return nil, fmt.Sprintf("%s %.200s", resp.Status, b)
}
