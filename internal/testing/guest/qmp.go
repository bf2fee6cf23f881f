package guest

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"time"
)

// QMP runs one QMP command on the VM's monitor over a fresh connection
// (greeting, qmp_capabilities, command) and returns its "return" value. It
// is a test convenience, independent of vmsnap's own QMP client, so that
// tests can drive and inspect a guest without the code under test. QEMU
// serves one monitor client at a time: do not call it while another client
// holds the socket.
func (vm *VM) QMP(ctx context.Context, command string, args any) (json.RawMessage, error) {
	return QMP(ctx, vm.qmpPath, command, args)
}

// QMP runs one command on the QMP socket at path; see (*VM).QMP.
func QMP(ctx context.Context, path, command string, args any) (json.RawMessage, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("qmp %s: %w", command, err)
	}
	defer conn.Close()
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(time.Minute)
	}
	conn.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Now()) })
	defer stop()

	dec := json.NewDecoder(conn)
	var greeting struct {
		QMP *json.RawMessage `json:"QMP"`
	}
	if err := dec.Decode(&greeting); err != nil || greeting.QMP == nil {
		return nil, fmt.Errorf("qmp %s: no QMP greeting on %s: %v", command, path, err)
	}
	exec := func(cmd string, args any) (json.RawMessage, error) {
		req := map[string]any{"execute": cmd}
		if args != nil {
			req["arguments"] = args
		}
		b, err := json.Marshal(req)
		if err != nil {
			return nil, err
		}
		if _, err := conn.Write(append(b, '\n')); err != nil {
			return nil, err
		}
		for {
			var resp struct {
				Return json.RawMessage `json:"return"`
				Error  *struct {
					Class string `json:"class"`
					Desc  string `json:"desc"`
				} `json:"error"`
				Event string `json:"event"`
			}
			if err := dec.Decode(&resp); err != nil {
				return nil, err
			}
			switch {
			case resp.Error != nil:
				return nil, fmt.Errorf("%s: %s", resp.Error.Class, resp.Error.Desc)
			case resp.Return != nil:
				return resp.Return, nil
			}
			// An event: skip it.
		}
	}
	if _, err := exec("qmp_capabilities", nil); err != nil {
		return nil, fmt.Errorf("qmp_capabilities: %w", err)
	}
	ret, err := exec(command, args)
	if err != nil {
		return nil, fmt.Errorf("qmp %s: %w", command, err)
	}
	return ret, nil
}
