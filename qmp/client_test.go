package qmp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	goqmp "github.com/digitalocean/go-qemu/qmp"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// dial connects to srv and closes the client when the test ends.
func dial(t *testing.T, srv *qmptest.Server) *qmp.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	c, err := qmp.Dial(ctx, srv.Path())
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func testContext(t *testing.T) context.Context {
	// Generous: it only matters when something hangs, and -race on a busy
	// machine is slow.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestDialNegotiatesAndReportsVersion(t *testing.T) {
	srv := qmptest.NewServer(t, func(_ *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		if cmd.Execute == "query-status" {
			return map[string]any{"status": "paused", "running": false, "singlestep": false}, nil
		}
		return nil, &qmp.Error{Class: "CommandNotFound", Desc: cmd.Execute}
	}, qmptest.WithVersion(8, 1, 3))
	c := dial(t, srv)

	if v := c.Version(); v.QEMU.Major != 8 || v.QEMU.Minor != 1 || v.QEMU.Micro != 3 {
		t.Errorf("Version() = %s, want 8.1.3", v)
	}
	if got := srv.Received(); len(got) != 1 || got[0].Execute != "qmp_capabilities" {
		t.Fatalf("server received %+v, want just qmp_capabilities", got)
	}
	st, err := c.Status(testContext(t))
	if err != nil {
		t.Fatal(err)
	}
	if st != (qmp.StatusInfo{Status: "paused", Running: false}) {
		t.Errorf("Status() = %+v", st)
	}
}

func TestDialWithoutQEMUIsVMNotFound(t *testing.T) {
	dir := t.TempDir()

	refused := filepath.Join(dir, "stale.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: refused, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false) // leave the socket file behind, as a crashed QEMU does
	ln.Close()

	regular := filepath.Join(dir, "file")
	if err := os.WriteFile(regular, nil, 0o600); err != nil {
		t.Fatal(err)
	}

	for name, path := range map[string]string{
		"missing": filepath.Join(dir, "missing.sock"),
		"refused": refused,
		"regular": regular,
	} {
		t.Run(name, func(t *testing.T) {
			_, err := qmp.Dial(testContext(t), path)
			if got := errcode.Of(err); got != errcode.VMNotFound {
				t.Fatalf("Dial error code = %s (%v), want VM_NOT_FOUND", got, err)
			}
			if !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "-qmp") {
				t.Errorf("error %q should name the path and say how QEMU must be started", err)
			}
		})
	}
}

// listenRaw starts a listener whose connections get greeting (if not empty)
// and are then held open without another word.
func listenRaw(t *testing.T, greeting string) string {
	path := filepath.Join(t.TempDir(), "raw.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	var conns []net.Conn
	var mu sync.Mutex
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			io.WriteString(c, greeting)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return path
}

func TestDialSilentPeerTimesOutAsBusy(t *testing.T) {
	path := listenRaw(t, "")
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	// The peer never greets: only the deadline can end Dial (a Dial that
	// ignored it would hang until go test's timeout).
	_, err := qmp.Dial(ctx, path)
	if errcode.Of(err) != errcode.Busy || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Dial to a peer that never greets: %v (code %s), want BUSY wrapping DeadlineExceeded", err, errcode.Of(err))
	}
}

// TestDialSilentPeerTimesOutWithoutCallerDeadline: a caller that gives no
// deadline still gets BUSY once the greeting timeout passes, with a message
// saying another client may hold the monitor.
func TestDialSilentPeerTimesOutWithoutCallerDeadline(t *testing.T) {
	qmp.SetTimeoutsForTest(t, 300*time.Millisecond, 0)
	path := listenRaw(t, "")
	start := time.Now()
	_, err := qmp.Dial(context.Background(), path)
	if elapsed := time.Since(start); elapsed < 250*time.Millisecond {
		t.Errorf("Dial gave up after %v, before its 300ms greeting timeout", elapsed)
	}
	if errcode.Of(err) != errcode.Busy || !strings.Contains(err.Error(), "another client probably holds the monitor") {
		t.Fatalf("Dial to a peer that never greets: %v (code %s), want BUSY saying another client may hold the monitor", err, errcode.Of(err))
	}
}

// TestCommandTimeoutWithoutCallerDeadline: a QEMU that greets and then
// never answers fails Dial's capabilities negotiation, and any command,
// within the command timeout even when the caller's context has no
// deadline.
func TestCommandTimeoutWithoutCallerDeadline(t *testing.T) {
	qmp.SetTimeoutsForTest(t, 0, 300*time.Millisecond)
	path := listenRaw(t, `{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": ""}, "capabilities": []}}`+"\n")
	start := time.Now()
	_, err := qmp.Dial(context.Background(), path)
	if elapsed := time.Since(start); elapsed < 250*time.Millisecond {
		t.Errorf("Dial gave up after %v, before its 300ms command timeout", elapsed)
	}
	if errcode.Of(err) != errcode.QMPError || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Dial to a peer that never answers: %v (code %s), want QMP_ERROR wrapping DeadlineExceeded", err, errcode.Of(err))
	}

	// "hang" is answered only when the test ends: only the command
	// timeout can end Execute.
	hang := make(chan struct{})
	srv := qmptest.NewServer(t, func(_ *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		if cmd.Execute == "hang" {
			<-hang
		}
		return nil, nil
	})
	t.Cleanup(func() { close(hang) })
	c := dial(t, srv)
	start = time.Now()
	err = c.Execute(context.Background(), "hang", nil, nil)
	if elapsed := time.Since(start); errcode.Of(err) != errcode.QMPError || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a command QEMU never answers: %v after %v, want QMP_ERROR wrapping DeadlineExceeded within the 300ms timeout", err, elapsed)
	}
}

func TestDialCancelledWhileWaitingForGreeting(t *testing.T) {
	path := listenRaw(t, "")
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	_, err := qmp.Dial(ctx, path)
	if errcode.Of(err) != errcode.QMPError || !errors.Is(err, context.Canceled) {
		t.Fatalf("Dial cancelled: %v (code %s), want QMP_ERROR wrapping Canceled", err, errcode.Of(err))
	}
}

func TestDialNonQMPPeer(t *testing.T) {
	path := listenRaw(t, "QEMU 7.2.0 monitor - type 'help' for more information\r\n")
	_, err := qmp.Dial(testContext(t), path)
	if errcode.Of(err) != errcode.QMPError || !strings.Contains(err.Error(), "HMP") {
		t.Fatalf("Dial to an HMP monitor: %v (code %s)", err, errcode.Of(err))
	}
}

func TestLargeReplies(t *testing.T) {
	srv := qmptest.NewServer(t, func(_ *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		var a struct{ Size int }
		cmd.Args(&a)
		return json.RawMessage(`{"blob": "` + strings.Repeat("0123456789abcdef", a.Size/16) + `"}`), nil
	})
	c := dial(t, srv)
	for _, size := range []int{100 << 10, 10<<20 + 64<<10} {
		var r struct{ Blob string }
		if err := c.Execute(testContext(t), "blob", map[string]int{"size": size}, &r); err != nil {
			t.Fatalf("%d-byte reply: %v", size, err)
		}
		if len(r.Blob) != size || r.Blob != strings.Repeat("0123456789abcdef", size/16) {
			t.Fatalf("%d-byte reply came back as %d bytes or corrupted", size, len(r.Blob))
		}
	}
}

func TestEventFloodDoesNotBlockReplies(t *testing.T) {
	const flood = 6000 // comfortably over qmp.EventQueueLimit
	srv := qmptest.NewServer(t, func(srv *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		if cmd.Execute == "flood" {
			for i := range flood {
				srv.Emit(goqmp.Event{Event: "SEQ", Data: map[string]any{"n": i}})
			}
		}
		return map[string]string{"ran": cmd.Execute}, nil
	})
	c := dial(t, srv)
	sub := c.Subscribe() // nobody reads it until the end
	defer sub.Close()
	idle := c.Subscribe() // closed without ever being read
	idle.Close()

	// QEMU writes events before the reply on the same stream, so once the
	// reply is in, the reader has dispatched every event.
	var r struct{ Ran string }
	if err := c.Execute(testContext(t), "flood", nil, &r); err != nil || r.Ran != "flood" {
		t.Fatalf("flood: %v %+v", err, r)
	}
	if err := c.Execute(testContext(t), "after", nil, &r); err != nil || r.Ran != "after" {
		t.Fatalf("command after the flood: %v %+v", err, r)
	}

	// The pump may hold one event outside the queue, ready to send.
	dropped := sub.Dropped()
	if lo, hi := uint64(flood-qmp.EventQueueLimit-1), uint64(flood-qmp.EventQueueLimit); dropped < lo || dropped > hi {
		t.Errorf("Dropped() = %d, want %d..%d", dropped, lo, hi)
	}

	// What is left is the newest events, in order, ending with the last.
	received, prev := 0, -1
	timeout := time.After(5 * time.Second)
	for prev != flood-1 {
		select {
		case ev := <-sub.C():
			n := int(ev.Data["n"].(float64))
			if n <= prev {
				t.Fatalf("event %d after %d", n, prev)
			}
			prev = n
			received++
		case <-timeout:
			t.Fatalf("stalled after %d events, last %d", received, prev)
		}
	}
	if uint64(received)+dropped != flood {
		t.Errorf("received %d + dropped %d != %d emitted", received, dropped, flood)
	}

	// A subscription made after the flood sees none of it.
	late := c.Subscribe()
	defer late.Close()
	srv.Emit(goqmp.Event{Event: "LATE"})
	ev, err := late.Wait(testContext(t), nil)
	if err != nil || ev.Event != "LATE" {
		t.Errorf("first event of a later subscription = %q, %v; want LATE", ev.Event, err)
	}
}

// TestEventQueueBoundedInBytes: large events a subscriber does not read
// are dropped, oldest first, once the queue holds EventQueueBytes, long
// before it holds EventQueueLimit events; the newest are delivered.
func TestEventQueueBoundedInBytes(t *testing.T) {
	const events, size = 64, 512 << 10 // 32 MiB in all, 64 events
	pad := strings.Repeat("e", size)
	srv := qmptest.NewServer(t, func(srv *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		if cmd.Execute == "flood" {
			for i := range events {
				srv.Emit(goqmp.Event{Event: "BIG", Data: map[string]any{"n": i, "pad": pad}})
			}
		}
		return nil, nil
	})
	c := dial(t, srv)
	sub := c.Subscribe()
	defer sub.Close()
	// 32 MiB of JSON through the client under -race on a busy machine: the
	// deadline guards against a hang only.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := c.Execute(ctx, "flood", nil, nil); err != nil {
		t.Fatal(err)
	}
	// Each event costs a little over 512 KiB: at most 15 fit in 8 MiB, and
	// the pump may hold one more.
	kept := uint64(qmp.EventQueueBytes / size)
	if d := sub.Dropped(); d < events-kept-1 || d > events-kept+1 {
		t.Fatalf("Dropped() = %d, want about %d (events - %d that fit in %d MiB)", d, events-kept, kept, qmp.EventQueueBytes>>20)
	}
	var last float64
	for last != events-1 {
		select {
		case ev := <-sub.C():
			last = ev.Data["n"].(float64)
		case <-ctx.Done():
			t.Fatalf("the newest events were not delivered (last %v)", last)
		}
	}
}

func TestDeadlineReturnsPromptlyAndClientRecovers(t *testing.T) {
	release := make(chan struct{})
	srv := qmptest.NewServer(t, func(_ *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		if cmd.Execute == "slow" {
			<-release
		}
		return map[string]string{"ran": cmd.Execute}, nil
	})
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	c := dial(t, srv)

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	// "slow" is answered only when the test ends: only the deadline can
	// end Execute.
	err := c.Execute(ctx, "slow", nil, nil)
	if !errors.Is(err, context.DeadlineExceeded) || errcode.Of(err) != errcode.QMPError {
		t.Fatalf("Execute past its deadline: %v (code %s)", err, errcode.Of(err))
	}

	// The late reply to "slow" must not be taken for the next command's.
	close(release)
	var r struct{ Ran string }
	if err := c.Execute(testContext(t), "next", nil, &r); err != nil || r.Ran != "next" {
		t.Fatalf("command after a timed-out one: %v, reply %+v", err, r)
	}

	// A context that is already done sends nothing.
	before := len(srv.Received())
	if err := c.Execute(ctx, "never", nil, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Execute with an expired context: %v", err)
	}
	if got := srv.Received(); len(got) != before {
		t.Errorf("a command with an expired context was sent: %+v", got[before:])
	}
}

func TestConcurrentExecuteMatchesRepliesByID(t *testing.T) {
	srv := qmptest.NewServer(t, func(_ *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond) // reorder replies
		return cmd.Arguments, nil
	}, qmptest.WithConcurrentHandlers())
	c := dial(t, srv)

	var wg sync.WaitGroup
	for g := range 32 {
		wg.Go(func() {
			for i := range 20 {
				want := fmt.Sprintf("%d/%d", g, i)
				var got struct{ Tag string }
				if err := c.Execute(testContext(t), "echo", map[string]string{"tag": want}, &got); err != nil {
					t.Error(err)
					return
				}
				if got.Tag != want {
					t.Errorf("sent %s, got the reply for %s", want, got.Tag)
				}
			}
		})
	}
	wg.Wait()
}

// fdServer is a fake QEMU whose getfd writes a greeting into the descriptor
// it receives, and fails like QEMU when none came.
func fdServer(t *testing.T) *qmptest.Server {
	return qmptest.NewServer(t, func(_ *qmptest.Server, cmd qmptest.Command, files []*os.File) (any, *qmp.Error) {
		var a struct{ FDName string }
		if err := cmd.Args(&a); err != nil {
			return nil, &qmp.Error{Class: "GenericError", Desc: err.Error()}
		}
		switch cmd.Execute {
		case "getfd":
			if len(files) != 1 {
				return nil, &qmp.Error{Class: "GenericError", Desc: fmt.Sprintf("got %d descriptors", len(files))}
			}
			defer files[0].Close()
			if _, err := io.WriteString(files[0], "written by qemu for "+a.FDName); err != nil {
				return nil, &qmp.Error{Class: "GenericError", Desc: err.Error()}
			}
		case "nofd":
			if len(files) != 0 {
				return nil, &qmp.Error{Class: "GenericError", Desc: fmt.Sprintf("got %d stray descriptors", len(files))}
			}
		}
		return nil, nil
	})
}

func TestExecuteWithFilePassesDescriptor(t *testing.T) {
	c := dial(t, fdServer(t))
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	err = c.ExecuteWithFile(testContext(t), "getfd", map[string]string{"fdname": "migration"}, nil, w)
	w.Close() // the server's copy is closed by its handler, so r sees EOF
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(r)
	if err != nil || string(got) != "written by qemu for migration" {
		t.Fatalf("read back %q, %v", got, err)
	}
	// Passing did not make the caller's pipe unusable for deadlines
	// (f.Fd() would have switched it to blocking mode).
	if err := r.SetReadDeadline(time.Now()); err != nil {
		t.Errorf("pipe lost non-blocking mode: %v", err)
	}
}

func TestExecuteWithFileInterleavedWithPlainCommands(t *testing.T) {
	c := dial(t, fdServer(t))
	var wg sync.WaitGroup
	for i := range 40 {
		wg.Go(func() {
			ctx := testContext(t)
			if i%2 == 1 {
				if err := c.Execute(ctx, "nofd", map[string]string{"fdname": "-"}, nil); err != nil {
					t.Error(err)
				}
				return
			}
			r, w, err := os.Pipe()
			if err != nil {
				t.Error(err)
				return
			}
			defer r.Close()
			name := fmt.Sprint("fd", i)
			err = c.ExecuteWithFile(ctx, "getfd", map[string]string{"fdname": name}, nil, w)
			w.Close()
			if err != nil {
				t.Error(err)
				return
			}
			if got, _ := io.ReadAll(r); string(got) != "written by qemu for "+name {
				t.Errorf("%s: read back %q", name, got)
			}
		})
	}
	wg.Wait()
}

func TestConnectionClosedMidReplyFailsPending(t *testing.T) {
	release := make(chan struct{})
	srv := qmptest.NewServer(t, func(_ *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		<-release
		return nil, nil
	})
	defer close(release)
	c := dial(t, srv)
	sub := c.Subscribe()

	// The first "block" occupies the fake's command loop, as a busy QEMU
	// would, and the second queues behind it; then QEMU dies mid-reply.
	pending := make(chan error, 2)
	for range 2 {
		go func() { pending <- c.Execute(context.Background(), "block", nil, nil) }()
	}
	time.Sleep(20 * time.Millisecond)
	srv.WriteRaw([]byte(`{"return": {"partial": "rep`))
	srv.CloseConnections()
	for range 2 {
		select {
		case err := <-pending:
			if errcode.Of(err) != errcode.QMPError || !strings.Contains(err.Error(), "QEMU closed the monitor connection") {
				t.Errorf("pending Execute: %v (code %s)", err, errcode.Of(err))
			}
		case <-time.After(2 * time.Second):
			t.Fatal("pending Execute still blocked after the connection closed")
		}
	}
	select {
	case <-c.Done():
	default:
		t.Error("Done not closed")
	}
	if !errors.Is(c.Err(), io.ErrUnexpectedEOF) {
		t.Errorf("Err() = %v, want one saying the reply was cut short", c.Err())
	}
	if _, ok := <-sub.C(); ok {
		t.Error("subscription channel still open after the connection ended")
	}
	if _, err := sub.Wait(testContext(t), nil); errcode.Of(err) != errcode.QMPError {
		t.Errorf("Wait on a dead connection: %v", err)
	}
	start := time.Now()
	// Without a deadline, only the dead connection can end it.
	if err := c.Execute(context.Background(), "after", nil, nil); errcode.Of(err) != errcode.QMPError {
		t.Errorf("Execute on a dead connection: %v after %v", err, time.Since(start))
	}
}

func TestConnectionClosedByCommand(t *testing.T) {
	srv := qmptest.NewServer(t, func(srv *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		srv.WriteRaw([]byte(`{"return": {"partial": "rep`))
		srv.CloseConnections()
		return nil, nil
	})
	c := dial(t, srv)
	err := c.Execute(testContext(t), "die", nil, nil)
	if errcode.Of(err) != errcode.QMPError || !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("Execute whose reply was cut: %v (code %s)", err, errcode.Of(err))
	}
}

func TestGarbageFromServerIsAnError(t *testing.T) {
	srv := qmptest.NewServer(t, func(srv *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		srv.WriteRaw([]byte("this is not json\r\n"))
		return nil, nil
	})
	c := dial(t, srv)
	err := c.Execute(testContext(t), "anything", nil, nil)
	if errcode.Of(err) != errcode.QMPError || !strings.Contains(err.Error(), "malformed") {
		t.Fatalf("Execute after garbage: %v (code %s)", err, errcode.Of(err))
	}
	select {
	case <-c.Done():
	case <-time.After(time.Second):
		t.Fatal("connection not ended after garbage")
	}
}

func TestQMPErrorKeepsClass(t *testing.T) {
	srv := qmptest.NewServer(t, func(_ *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		return nil, &qmp.Error{Class: "DeviceNotFound", Desc: "Device 'disk9' not found"}
	})
	c := dial(t, srv)
	err := c.Execute(testContext(t), "device_del", map[string]string{"id": "disk9"}, nil)

	var qerr *qmp.Error
	if !errors.As(err, &qerr) {
		t.Fatalf("error %v (%T) does not wrap *qmp.Error", err, err)
	}
	if qerr.Class != "DeviceNotFound" || qerr.Command != "device_del" || qerr.Desc != "Device 'disk9' not found" {
		t.Errorf("got %+v", qerr)
	}
	if errcode.Of(err) != errcode.QMPError {
		t.Errorf("errcode.Of = %s", errcode.Of(err))
	}
	if want := "qmp: device_del: DeviceNotFound: Device 'disk9' not found"; err.Error() != want {
		t.Errorf("Error() = %q, want %q", err.Error(), want)
	}
	var coded interface{ ErrorCode() string }
	if !errors.As(err, &coded) || coded.ErrorCode() != "QMP_ERROR" {
		t.Errorf("ErrorCode() not QMP_ERROR")
	}
	// The connection survives a refused command.
	if c.Err() != nil {
		t.Errorf("connection ended after a QMP error: %v", c.Err())
	}
}

func TestCloseFailsPendingAndIsIdempotent(t *testing.T) {
	release := make(chan struct{})
	srv := qmptest.NewServer(t, func(_ *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		<-release
		return nil, nil
	})
	defer close(release)
	c := dial(t, srv)
	pending := make(chan error, 1)
	go func() { pending <- c.Execute(context.Background(), "block", nil, nil) }()
	time.Sleep(20 * time.Millisecond)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-pending:
		if !errors.Is(err, net.ErrClosed) || errcode.Of(err) != errcode.QMPError {
			t.Errorf("pending Execute after Close: %v", err)
		}
	case <-time.After(time.Second):
		t.Fatal("pending Execute not released by Close")
	}
	if err := c.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestWaitForMigrationEvent(t *testing.T) {
	srv := qmptest.NewServer(t, func(srv *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		// Like QEMU, migrate returns at once and reports progress as events.
		go func() {
			for _, st := range []string{"setup", "active", "completed"} {
				time.Sleep(5 * time.Millisecond)
				srv.Emit(goqmp.Event{Event: "MIGRATION", Data: map[string]any{"status": st}})
			}
		}()
		return nil, nil
	})
	c := dial(t, srv)
	sub := c.Subscribe()
	defer sub.Close()
	if err := c.Execute(testContext(t), "migrate", map[string]string{"uri": "fd:x"}, nil); err != nil {
		t.Fatal(err)
	}
	ev, err := sub.Wait(testContext(t), func(ev goqmp.Event) bool {
		return ev.Event == "MIGRATION" && ev.Data["status"] == "completed"
	})
	if err != nil || ev.Data["status"] != "completed" || ev.Timestamp.Seconds == 0 {
		t.Fatalf("Wait = %+v, %v", ev, err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if _, err := sub.Wait(ctx, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Wait with no event coming: %v", err)
	}
	sub.Close()
	if _, err := sub.Wait(testContext(t), nil); err == nil || !strings.Contains(err.Error(), "subscription was closed") {
		t.Errorf("Wait on a closed subscription: %v", err)
	}
}

func TestMonitorAdapter(t *testing.T) {
	srv := qmptest.NewServer(t, func(srv *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		switch cmd.Execute {
		case "query-status":
			srv.Emit(goqmp.Event{Event: "QUERIED"})
			return qmp.StatusInfo{Status: "running", Running: true}, nil
		}
		return nil, &qmp.Error{Class: "CommandNotFound", Desc: "The command " + cmd.Execute + " has not been found"}
	})
	var mon goqmp.Monitor = qmp.NewMonitor(srv.Path(), 2*time.Second)
	if _, err := mon.Run([]byte(`{"execute":"query-status"}`)); err == nil {
		t.Error("Run before Connect succeeded")
	}
	if err := mon.Connect(); err != nil {
		t.Fatal(err)
	}
	defer mon.Disconnect()
	ctx, cancel := context.WithCancel(context.Background())
	events, err := mon.Events(ctx)
	if err != nil {
		t.Fatal(err)
	}

	raw, err := mon.Run([]byte(`{"execute":"query-status","id":"mine"}`))
	if err != nil {
		t.Fatal(err)
	}
	var resp struct {
		ID     json.RawMessage
		Return qmp.StatusInfo
	}
	if err := json.Unmarshal(raw, &resp); err != nil || resp.Return.Status != "running" || len(resp.ID) == 0 {
		t.Errorf("Run returned %s (%v)", raw, err)
	}
	select {
	case ev := <-events:
		if ev.Event != "QUERIED" {
			t.Errorf("event %q", ev.Event)
		}
	case <-time.After(2 * time.Second):
		t.Error("no event from Events")
	}
	cancel()
	select {
	case _, ok := <-events:
		if ok {
			t.Error("event after the Events context was cancelled")
		}
	case <-time.After(2 * time.Second):
		t.Error("Events channel not closed after its context was cancelled")
	}

	_, err = mon.Run([]byte(`{"execute":"no-such"}`))
	var qerr *qmp.Error
	if !errors.As(err, &qerr) || qerr.Class != "CommandNotFound" {
		t.Errorf("Run of an unknown command: %v", err)
	}
	if _, err := mon.Run([]byte(`{"arguments":{}}`)); errcode.Of(err) != errcode.InvalidInput {
		t.Errorf("Run without execute: %v", err)
	}
}

func TestEventsBeforeRemoteCloseAreDelivered(t *testing.T) {
	srv := qmptest.NewServer(t, func(srv *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		for _, name := range []string{"STOP", "SHUTDOWN"} {
			srv.Emit(goqmp.Event{Event: name})
		}
		srv.CloseConnections()
		return nil, nil
	})
	c := dial(t, srv)
	sub := c.Subscribe()
	if err := c.Execute(testContext(t), "quit", nil, nil); errcode.Of(err) != errcode.QMPError {
		t.Fatalf("Execute whose connection closed: %v", err)
	}
	<-c.Done()
	var got []string
	for ev := range sub.C() { // ends: the channel closes after the queued events
		got = append(got, ev.Event)
	}
	if strings.Join(got, ",") != "STOP,SHUTDOWN" {
		t.Errorf("events after the connection ended: %v, want STOP,SHUTDOWN", got)
	}
}

func TestClientCloseEndsSubscriptions(t *testing.T) {
	srv := qmptest.NewServer(t, func(srv *qmptest.Server, cmd qmptest.Command, _ []*os.File) (any, *qmp.Error) {
		for range 100 {
			srv.Emit(goqmp.Event{Event: "TICK"})
		}
		return nil, nil
	})
	c := dial(t, srv)
	sub := c.Subscribe() // never read: its pump is stuck sending
	if err := c.Execute(testContext(t), "tick", nil, nil); err != nil {
		t.Fatal(err)
	}
	c.Close()
	n := 0
	timeout := time.After(2 * time.Second)
	for {
		select {
		case _, ok := <-sub.C():
			if !ok {
				if n > 1 {
					t.Errorf("%d events delivered after Close, want at most the one in flight", n)
				}
				return
			}
			n++
		case <-timeout:
			t.Fatal("subscription channel still open after the client was closed")
		}
	}
}
