package qmp_test

// Arbitrary bytes from "QEMU": greetings, replies, events, huge lines and
// connections closed mid-reply. The client must never panic or hang past
// its deadline, and every error it returns carries a code.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp"
)

var fuzzSock atomic.Int64

const testGreeting = `{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": ""}, "capabilities": ["oob"]}}` + "\r\n"

// rawQEMU listens on an abstract unix socket (nothing on disk) and serves
// one connection: greeting, then for each command line it reads, the next
// script entry. A script entry of nil means "close the connection now".
func rawQEMU(tb testing.TB, greeting []byte, script [][]byte, closeAtEnd bool) string {
	tb.Helper()
	name := fmt.Sprintf("@vmsnap-qmp-fuzz-%d-%d", time.Now().UnixNano(), fuzzSock.Add(1))
	ln, err := net.Listen("unix", name)
	if err != nil {
		tb.Fatal(err)
	}
	done := make(chan struct{})
	tb.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		stop := context.AfterFunc(tb.Context(), func() { c.Close() })
		defer stop()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Write(greeting); err != nil {
			return
		}
		br := bufio.NewReader(c)
		for _, s := range script {
			if _, err := br.ReadBytes('\n'); err != nil {
				return
			}
			if s == nil {
				return
			}
			if _, err := c.Write(s); err != nil {
				return
			}
		}
		if closeAtEnd {
			return
		}
		// Hold the connection open and silent until the client goes.
		br.WriteTo(discard{})
	}()
	return name
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// FuzzClientReplies: mode picks where the fuzzer's bytes go: into the
// greeting, the reply to qmp_capabilities, or the reply to the first real
// command (optionally followed by the connection closing).
func FuzzClientReplies(f *testing.F) {
	ok := []byte(`{"return": {}, "id": 1}` + "\r\n")
	f.Add(uint8(0), []byte(testGreeting))
	f.Add(uint8(0), []byte("QEMU 7.2.0 monitor - type 'help' for more information\r\n"))
	f.Add(uint8(1), ok)
	f.Add(uint8(1), []byte(`{"error": {"class": "CommandNotFound", "desc": "nope"}, "id": 1}`+"\n"))
	f.Add(uint8(2), []byte(`{"return": {"status": "running", "running": true}, "id": 2}`+"\n"))
	f.Add(uint8(2), []byte(`{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "STOP"}`+"\n"+`{"return": {}, "id": 2}`+"\n"))
	f.Add(uint8(2), []byte(`{"event": "MIGRATION", "data": {"status": "active"}}`+"\n"+`{"return": {"st`))
	f.Add(uint8(3), []byte(`{"return": {"partial": "rep`))
	f.Add(uint8(2), []byte(`{"return": {}, "id": 3}`+"\n"+`{"return": {}, "id": "2"}`+"\n"+`{"return": {}, "id": 2}`+"\n"))
	f.Add(uint8(2), []byte(`{"return": [1,2,3], "id": 2}`+"\n"))
	f.Add(uint8(2), []byte(`{"id": 2, "return": {}, "error": {"class": "GenericError", "desc": "both"}}`+"\n"))
	f.Add(uint8(2), []byte("\n\n\r\n   \n"+`{"return": {}, "id": 2}`+"\n"))
	f.Add(uint8(2), []byte("\xff\xfe\x00garbage\n"))
	f.Add(uint8(2), []byte(`{"return": {}, "id": 18446744073709551617}`+"\n"))
	f.Fuzz(func(t *testing.T, mode uint8, data []byte) {
		ok := []byte(`{"return": {}, "id": 1}` + "\r\n")
		var greeting []byte
		var script [][]byte
		closeAtEnd := false
		switch mode % 4 {
		case 0:
			greeting = data
		case 1:
			greeting, script = []byte(testGreeting), [][]byte{data}
		case 2:
			greeting, script = []byte(testGreeting), [][]byte{ok, data}
		case 3:
			greeting, script, closeAtEnd = []byte(testGreeting), [][]byte{ok, data}, true
		}
		path := rawQEMU(t, greeting, script, closeAtEnd)
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		c, err := qmp.Dial(ctx, path)
		if err != nil {
			checkCoded(t, "Dial", err)
			return
		}
		defer c.Close()
		sub := c.Subscribe()
		defer sub.Close()
		var out struct {
			Status  string `json:"status"`
			Running bool   `json:"running"`
		}
		err = c.Execute(ctx, "query-status", nil, &out)
		if err != nil {
			checkCoded(t, "Execute", err)
		}
		// Events are drained, never block the reader. (The channel is
		// closed once the connection ends.)
	drain:
		for {
			select {
			case _, ok := <-sub.C():
				if !ok {
					break drain
				}
			default:
				break drain
			}
		}
	})
}

// checkCoded checks that a call that failed says why with a code. (That
// it returned at all is the check that it kept its caller's deadline: the
// scripted QEMU never answers past its script.)
func checkCoded(t *testing.T, what string, err error) {
	t.Helper()
	switch errcode.Of(err) {
	case errcode.QMPError, errcode.Busy, errcode.VMNotFound:
	default:
		t.Fatalf("%s: %v (code %s), want QMP_ERROR, BUSY or VM_NOT_FOUND", what, err, errcode.Of(err))
	}
}

// TestHugeReplyLine: a reply just under MaxLineBytes is read whole; a line
// over it (a 100 MiB one, whole, cut off by the connection's end, or
// garbage) ends the connection with QMP_ERROR as soon as the cap is
// passed, allocating a small multiple of the cap, not of the line.
func TestHugeReplyLine(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates a few hundred MiB")
	}
	const size = 100 << 20
	under := qmp.MaxLineBytes - 1<<10
	ok := []byte(`{"return": {}, "id": 1}` + "\r\n")
	blob := func(n int) []byte { return append([]byte(`{"return": {"blob": "`), bytes.Repeat([]byte("a"), n)...) }
	for _, tc := range []struct {
		name    string
		reply   []byte
		closeIt bool
		wantErr bool
	}{
		{"just under the cap", append(blob(under), `"}, "id": 2}`+"\n"...), false, false},
		{"whole reply", append(blob(size), `"}, "id": 2}`+"\n"...), false, true},
		{"no newline then close", blob(size), true, true},
		{"garbage line", append(bytes.Repeat([]byte("x"), size), '\n'), false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := rawQEMU(t, []byte(testGreeting), [][]byte{ok, tc.reply}, tc.closeIt)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			c, err := qmp.Dial(ctx, path)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			runtime.GC()
			var ms0, ms1 runtime.MemStats
			runtime.ReadMemStats(&ms0)
			start := time.Now()
			var out struct{ Blob string }
			err = c.Execute(ctx, "query-huge", nil, &out)
			elapsed := time.Since(start)
			runtime.ReadMemStats(&ms1)
			alloc := ms1.TotalAlloc - ms0.TotalAlloc
			t.Logf("%s: %v, %d MiB allocated for a %d MiB line", tc.name, elapsed.Round(time.Millisecond), alloc>>20, (len(tc.reply))>>20)
			if tc.wantErr {
				if errcode.Of(err) != errcode.QMPError {
					t.Fatalf("Execute = %v (code %s), want QMP_ERROR", err, errcode.Of(err))
				}
				if strings.Count(err.Error(), "a") > 1000 {
					t.Fatalf("the error repeats the huge line: %d bytes", len(err.Error()))
				}
				if !tc.closeIt && !strings.Contains(err.Error(), "longer than 16 MiB") {
					t.Fatalf("the error does not say the line was too long: %v", err)
				}
				select {
				case <-c.Done():
				case <-ctx.Done():
					t.Fatal("the connection is still up after an over-long line")
				}
			} else if err != nil || len(out.Blob) != under {
				t.Fatalf("Execute = %v, %d bytes", err, len(out.Blob))
			}
			// The line in pieces (up to twice the cap as it grows), the
			// reply's copy and its decoded string: never the whole line.
			if limit := uint64(6 * qmp.MaxLineBytes); alloc > limit {
				t.Errorf("a %d MiB line allocated %d MiB, over %d MiB", len(tc.reply)>>20, alloc>>20, limit>>20)
			}
		})
	}
}
