package qmp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	goqmp "github.com/digitalocean/go-qemu/qmp"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp"
)

// startQEMU runs a machine-less, paused QEMU with a QMP socket and returns
// the socket's path once QEMU listens on it, and a channel closed when QEMU
// exits.
func startQEMU(t *testing.T) (sock string, exited <-chan struct{}) {
	t.Helper()
	bin, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		t.Skip("SKIPPED: qemu-system-x86_64 is not in PATH, so the client is untested against a real QEMU")
	}
	sock = filepath.Join(t.TempDir(), "qmp.sock")
	var stderr bytes.Buffer
	proc := exec.Command(bin, "-accel", "tcg", "-machine", "none", "-nodefaults", "-display", "none",
		"-qmp", "unix:"+sock+",server=on,wait=off", "-S")
	proc.Stderr = &stderr
	if err := proc.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { proc.Wait(); close(done) }()
	t.Cleanup(func() {
		proc.Process.Kill()
		<-done
		if t.Failed() {
			t.Logf("qemu stderr: %s", stderr.String())
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		// Accepting, not just bound: QEMU creates the socket file a
		// moment before it listens.
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			return sock, done
		}
		select {
		case <-done:
			t.Fatalf("qemu exited at startup: %s", stderr.String())
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatal("qemu did not create its QMP socket within 10s")
		}
	}
}

func TestRealQEMU(t *testing.T) {
	sock, exited := startQEMU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := qmp.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	if v := c.Version(); v.QEMU.Major < 7 {
		t.Errorf("Version() = %s, want 7.x or later", v)
	}

	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Running || st.Status != "prelaunch" {
		t.Errorf("status of a QEMU started with -S = %+v, want not running, prelaunch", st)
	}

	// QEMU serves one client per socket: a second one is connected by the
	// kernel but never greeted.
	busyCtx, busyCancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err = qmp.Dial(busyCtx, sock)
	busyCancel()
	if errcode.Of(err) != errcode.Busy {
		t.Errorf("second Dial while connected: %v (code %s), want BUSY", err, errcode.Of(err))
	}

	var schema json.RawMessage
	if err := c.Execute(ctx, "query-qmp-schema", nil, &schema); err != nil {
		t.Fatal(err)
	}
	var entries []struct {
		Name     string `json:"name"`
		MetaType string `json:"meta-type"`
	}
	if err := json.Unmarshal(schema, &entries); err != nil {
		t.Fatal(err)
	}
	found := map[string]string{}
	for _, e := range entries {
		found[e.Name] = e.MetaType
	}
	if len(schema) <= 64<<10 || found["getfd"] != "command" || found["MIGRATION"] != "event" {
		t.Errorf("query-qmp-schema: %d bytes, getfd %q, MIGRATION %q", len(schema), found["getfd"], found["MIGRATION"])
	}

	// getfd: QEMU keeps the pipe's write end open until closefd, so the read
	// end sees EOF only after closefd.
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	err = c.ExecuteWithFile(ctx, "getfd", map[string]string{"fdname": "vmsnap-test"}, nil, w)
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	r.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if _, err := r.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("read from the pipe QEMU holds: %v, want a timeout (no EOF while QEMU holds the write end)", err)
	}
	if err := c.Execute(ctx, "closefd", map[string]string{"fdname": "vmsnap-test"}, nil); err != nil {
		t.Fatal(err)
	}
	r.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := r.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("read after closefd: %v, want EOF", err)
	}

	var qerr *qmp.Error
	err = c.Execute(ctx, "closefd", map[string]string{"fdname": "vmsnap-test"}, nil)
	if !errors.As(err, &qerr) || qerr.Class != "GenericError" || errcode.Of(err) != errcode.QMPError {
		t.Errorf("closefd of an unknown name: %v", err)
	}
	err = c.Execute(ctx, "getfd", map[string]string{"fdname": "none"}, nil)
	if !errors.As(err, &qerr) || qerr.Class != "GenericError" {
		t.Errorf("getfd without a descriptor: %v", err)
	}
	err = c.Execute(ctx, "no-such-command", nil, nil)
	if !errors.As(err, &qerr) || qerr.Class != "CommandNotFound" {
		t.Errorf("unknown command: %v", err)
	}

	// go-qemu's Monitor interface over the same connection.
	raw, err := c.Monitor(5 * time.Second).Run([]byte(`{"execute":"query-version"}`))
	var ver struct{ Return goqmp.Version }
	if err != nil || json.Unmarshal(raw, &ver) != nil || ver.Return.QEMU != c.Version().QEMU {
		t.Errorf("Monitor.Run(query-version) = %s, %v", raw, err)
	}

	// quit: QEMU sends SHUTDOWN, then the reply, then hangs up.
	sub := c.Subscribe()
	defer sub.Close()
	if err := c.Execute(ctx, "quit", nil, nil); err != nil {
		t.Fatalf("quit: %v", err)
	}
	ev, err := sub.Wait(ctx, func(ev goqmp.Event) bool { return ev.Event == "SHUTDOWN" })
	if err != nil || ev.Data["reason"] != "host-qmp-quit" {
		t.Errorf("SHUTDOWN event = %+v, %v", ev, err)
	}
	select {
	case <-c.Done():
		if !errcode.Is(c.Err(), errcode.QMPError) {
			t.Errorf("Err() after quit = %v", c.Err())
		}
	case <-ctx.Done():
		t.Fatal("connection still up after quit")
	}
	if err := c.Execute(ctx, "query-status", nil, nil); err == nil {
		t.Error("command after quit succeeded")
	}
	select {
	case <-exited:
	case <-ctx.Done():
		t.Error("QEMU still running after quit")
	}
}
