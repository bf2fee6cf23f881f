//go:build linux

package agent

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// The agent, with registry credentials from a Docker config directory, never
// puts them in its log (at debug level), in an operation's error, in its
// events or in its metrics: checkpoints through a real registry
// (internal/testing/registry) with a wrong and with the right password.
func TestAgentNeverShowsRegistryCredentials(t *testing.T) {
	reg := registry.Start(t)
	secrets := map[string]string{
		"password":              reg.Password,
		"base64(user:password)": base64.StdEncoding.EncodeToString([]byte(reg.User + ":" + reg.Password)),
		"base64(user:wrong)":    base64.StdEncoding.EncodeToString([]byte(reg.User + ":not-" + reg.Password)),
	}
	check := func(where string, data []byte) {
		t.Helper()
		for name, s := range secrets {
			if bytes.Contains(data, []byte(s)) {
				t.Errorf("%s holds the %s:\n%s", where, name, data)
			}
		}
	}
	vm := qmptest.NewFakeQEMU(t, "running", randomState(t, 2<<20))

	for _, tc := range []struct {
		name   string
		config string
		want   errcode.Code
	}{
		{"wrong password", reg.WrongConfigDir, errcode.AuthFailed},
		{"right password", reg.ConfigDir, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := newStaticResolver()
			res.add(uid1, vm.Path())
			log := &syncBuffer{}
			a := startAgentConfig(t, Config{
				StateDir: t.TempDir(), Resolver: res, MaxConcurrent: 1, AllowRepositories: []string{reg.Host + "/vms"},
				Store:  []ociimage.Option{ociimage.WithRegistryConfig(tc.config), ociimage.WithCAFile(reg.CAFile)},
				Logger: slog.New(slog.NewJSONHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug})),
			})
			// Follow every event from the start.
			events := &syncBuffer{}
			ectx, ecancel := context.WithCancel(context.Background())
			edone := make(chan struct{})
			go func() {
				defer close(edone)
				req, _ := http.NewRequestWithContext(ectx, http.MethodGet, "http://agent/v1/events", nil)
				resp, err := a.client.http.Do(req)
				if err != nil {
					return
				}
				defer resp.Body.Close()
				_, _ = io.Copy(events, resp.Body)
			}()
			op, err := a.client.Checkpoint(context.Background(), api.CheckpointRequest{
				VM: api.VMRef{PodUID: uid1, Container: "qemu", QMPPath: "/run/vm/qmp.sock"}, Image: reg.Host + "/vms/agent:vm1", Mode: "snapshot",
			})
			if err != nil {
				t.Fatal(err)
			}
			final := waitOp(t, a.client, op.ID)
			if tc.want == "" {
				if final.State != api.StateSucceeded {
					t.Fatalf("checkpoint %s: %+v", final.State, final.Error)
				}
			} else {
				if final.State != api.StateFailed || final.Error == nil || final.Error.Code != tc.want {
					t.Fatalf("checkpoint %s, %+v; want failed %s", final.State, final.Error, tc.want)
				}
				if !strings.Contains(final.Error.Message, "refused access") || !strings.Contains(final.Error.Message, filepath.Join(tc.config, "config.json")) {
					t.Fatalf("the AUTH_FAILED message does not say what was refused and which file's credentials were used: %s", final.Error.Message)
				}
				t.Logf("AUTH_FAILED: %s", final.Error.Message)
			}
			b, _ := json.Marshal(final)
			check("the operation", b)
			list, _ := a.client.List(context.Background())
			b, _ = json.Marshal(list)
			check("the operation list", b)
			check("the metrics", []byte(get(t, a, "/metrics")))
			time.Sleep(100 * time.Millisecond)
			ecancel()
			<-edone
			if !strings.Contains(events.String(), `"state":"`+final.State+`"`) {
				t.Fatalf("the event stream missed the end: %s", events.String())
			}
			check("the event stream", []byte(events.String()))
			a.stop()
			if !strings.Contains(log.String(), "checkpoint requested") {
				t.Fatalf("the agent logged nothing useful: %s", log.String())
			}
			check("the agent's log", []byte(log.String()))
		})
	}
	if vm.Status() != "running" {
		t.Fatalf("VM is %s", vm.Status())
	}
}
