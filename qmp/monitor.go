package qmp

import (
	"bytes"
	"context"
	"encoding/json"
	"strconv"
	"sync"
	"time"

	goqmp "github.com/digitalocean/go-qemu/qmp"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Monitor adapts a Client to go-qemu's qmp.Monitor interface, so code
// written against go-qemu (its qemu.Domain, for one) runs over this
// transport.
type Monitor struct {
	path    string
	timeout time.Duration

	mu     sync.Mutex
	client *Client
}

var _ goqmp.Monitor = (*Monitor)(nil)

// NewMonitor returns a Monitor that dials path on Connect. A non-zero
// timeout bounds Connect and each Run, which go-qemu's interface gives no
// other way to bound.
func NewMonitor(path string, timeout time.Duration) *Monitor {
	return &Monitor{path: path, timeout: timeout}
}

// Monitor returns a Monitor over this already connected client; its Connect
// does nothing and its Disconnect closes the client. timeout is as for
// NewMonitor.
func (c *Client) Monitor(timeout time.Duration) *Monitor {
	return &Monitor{timeout: timeout, client: c}
}

// Client returns the underlying client, or nil before Connect.
func (m *Monitor) Client() *Client {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.client
}

func (m *Monitor) context() (context.Context, context.CancelFunc) {
	if m.timeout > 0 {
		return context.WithTimeout(context.Background(), m.timeout)
	}
	return context.WithCancel(context.Background())
}

// Connect dials the socket unless a live connection exists.
func (m *Monitor) Connect() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.client != nil && m.client.Err() == nil {
		return nil
	}
	if m.path == "" {
		return errcode.New(errcode.QMPError, "qmp: the monitor's connection has ended and it has no socket path to dial again")
	}
	ctx, cancel := m.context()
	defer cancel()
	c, err := Dial(ctx, m.path)
	if err != nil {
		return err
	}
	m.client = c
	return nil
}

// Disconnect closes the connection.
func (m *Monitor) Disconnect() error {
	c := m.Client()
	if c == nil {
		return nil
	}
	return c.Close()
}

func (m *Monitor) connected() (*Client, error) {
	c := m.Client()
	if c == nil {
		return nil, errcode.New(errcode.QMPError, "qmp: the monitor is not connected: call Connect first")
	}
	return c, nil
}

// Run sends a raw QMP command such as {"execute":"query-status"} and returns
// the whole raw response object, as go-qemu's SocketMonitor does. Any "id"
// in the command is replaced by the client's own, which the response echoes.
// A refusal by QEMU is an error wrapping *Error.
func (m *Monitor) Run(command []byte) ([]byte, error) {
	c, err := m.connected()
	if err != nil {
		return nil, err
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(command, &obj); err != nil {
		return nil, errcode.Wrap(errcode.InvalidInput, err, "qmp: the command is not a JSON object")
	}
	var name string
	if err := json.Unmarshal(obj["execute"], &name); err != nil || name == "" {
		return nil, errcode.New(errcode.InvalidInput, "qmp: the command has no \"execute\" member: %s", truncate(command, 200))
	}
	ctx, cancel := m.context()
	defer cancel()
	r, err := c.roundTrip(ctx, name, nil, func(id uint64) ([]byte, error) {
		obj["id"] = json.RawMessage(strconv.FormatUint(id, 10))
		return json.Marshal(obj)
	})
	if err != nil {
		return nil, err
	}
	return bytes.TrimSpace(r.line), nil
}

// Events subscribes to QEMU's events. The channel closes when ctx ends or the
// connection does; unlike SocketMonitor's, a reader that stops reading costs
// dropped events, never stalled commands.
func (m *Monitor) Events(ctx context.Context) (<-chan goqmp.Event, error) {
	c, err := m.connected()
	if err != nil {
		return nil, err
	}
	s := c.Subscribe()
	context.AfterFunc(ctx, s.Close)
	return s.C(), nil
}
