package ociimage

import (
	"context"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// A server that answers bytes that are neither TLS nor HTTP is no
// registry, whether vmsnap speaks TLS or (allowed) plain HTTP to it: the
// error says to check the address, at once, without retries.
func TestRegistryThatIsNoRegistry(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = io.WriteString(c, "SSH-2.0-OpenSSH_9.2p1\r\n\x00\x01garbage\r\n\r\n")
			c.Close()
		}
	}()
	host := ln.Addr().String()
	for name, opts := range map[string][]Option{
		"TLS":        nil,
		"plain HTTP": {WithInsecureRegistry(host)},
	} {
		t.Run(name, func(t *testing.T) {
			ref, _ := ParseReference(host + "/vms/x:t")
			config := t.TempDir()
			writeFile(t, filepath.Join(config, "config.json"), `{"auths":{}}`)
			repo, err := Open(context.Background(), ref, append(opts, WithRegistryConfig(config), WithRetry(4, time.Second))...)
			if err != nil {
				t.Fatal(err)
			}
			_, err = repo.Resolve(context.Background())
			if errcode.Of(err) != errcode.RegistryError || !strings.Contains(err.Error(), "does not answer as a registry (neither TLS nor HTTP)") ||
				!strings.Contains(err.Error(), "check the registry's address and port") {
				t.Fatalf("got %v", err)
			}
			if strings.Contains(err.Error(), "gave up after") {
				t.Fatalf("retried what no retry can fix: %v", err)
			}
		})
	}
}

// A connection the registry dropped mid-transfer says so, whichever end
// noticed first: a reset, a broken pipe, an early EOF, or the client's
// own end closed under a write.
func TestUnreachableNamesADroppedConnection(t *testing.T) {
	for _, err := range []error{
		io.ErrUnexpectedEOF,
		&net.OpError{Op: "read", Err: syscall.ECONNRESET},
		&net.OpError{Op: "write", Err: syscall.EPIPE},
		&net.OpError{Op: "write", Err: net.ErrClosed},
	} {
		if failed, _ := unreachable(fmt.Errorf("Put \"https://r/v2/x\": %w", err), "r"); !strings.Contains(failed, "closed the connection mid-transfer") {
			t.Errorf("%v: %q, want it to say the registry closed the connection", err, failed)
		}
	}
}
