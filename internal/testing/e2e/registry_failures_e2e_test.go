//go:build linux

package e2e

// The failure table: every command that talks to a registry, run as a user
// runs it (the built binary, --json), against every way a registry fails
// (registry_failures_env_e2e_test.go): each gets its documented code and
// exit status, a message that says what to do, a JSON error object, one
// line on stderr and never a panic; and what the command touches is as it
// was (the VM runs, no tag moved, no file left behind).

import (
	"bytes"
	"context"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// failureCommand is one command of the table: its arguments against a
// host (it may start a fake QEMU for the run), and what must hold after it
// failed.
type failureCommand struct {
	name  string
	agent bool // through the node agent's API (--agent)
	args  func(t *testing.T, e *failureEnv, host string, r *failureRun) []string
	check func(t *testing.T, e *failureEnv, r *failureRun)
}

// failureRun is one command against one fault, and what it did.
type failureRun struct {
	cmd   failureCommand
	fault registryFault
	args  []string
	vm    *qmptest.FakeQEMU
	dir   string
	tag   string

	stdout, stderr []byte
	exit           int
	took           time.Duration
}

func failureCommands() []failureCommand {
	return []failureCommand{
		{name: "checkpoint", args: checkpointArgs, check: checkVMRunsAndNoTag},
		{name: "restore --image", args: func(t *testing.T, e *failureEnv, host string, r *failureRun) []string {
			r.vm = qmptest.NewFakeQEMU(t, "inmigrate", nil)
			return []string{"restore", "--qmp", r.vm.Path(), "--image", host + "/vms/fail@" + e.state}
		}, check: checkNotLoaded},
		{name: "restore --disk-image", args: func(t *testing.T, e *failureEnv, host string, r *failureRun) []string {
			return []string{"restore", "--disk-image", host + "/vms/fail-disk@" + e.disk, "--disk", filepath.Join(r.dir, "overlay.qcow2")}
		}, check: checkNothingLeft},
		{name: "restore --to-dir", args: func(t *testing.T, e *failureEnv, host string, r *failureRun) []string {
			return []string{"restore", "--image", host + "/vms/fail@" + e.state, "--to-dir", r.dir}
		}, check: checkNothingLeft},
		{name: "prepare", args: func(t *testing.T, e *failureEnv, host string, r *failureRun) []string {
			return []string{"prepare", host + "/vms/fail-mf@" + e.memoryFile, "--cache-dir", r.dir}
		}, check: checkNothingLeft},
		{name: "inspect", args: func(t *testing.T, e *failureEnv, host string, r *failureRun) []string {
			return []string{"inspect", host + "/vms/fail:t"}
		}},
		{name: "prune", args: func(t *testing.T, e *failureEnv, host string, r *failureRun) []string {
			return []string{"prune", host + "/vms/fail", "--keep", "1", "--dry-run"}
		}},
		{name: "agent checkpoint", agent: true, args: func(t *testing.T, e *failureEnv, host string, r *failureRun) []string {
			args := checkpointArgs(t, e, host, r)[:5] // checkpoint --qmp P --image REF
			return append(args, "--pod-uid", e.pods.add(r.vm), "--container", "qemu")
		}, check: checkVMRunsAndNoTag},
		{name: "agent restore", agent: true, args: func(t *testing.T, e *failureEnv, host string, r *failureRun) []string {
			r.vm = qmptest.NewFakeQEMU(t, "inmigrate", nil)
			return []string{"restore", "--qmp", "/run/vm/qmp.sock", "--image", host + "/vms/fail@" + e.state, "--pod-uid", e.pods.add(r.vm), "--container", "qemu"}
		}, check: checkNotLoaded},
		{name: "agent prepare", agent: true, args: func(t *testing.T, e *failureEnv, host string, r *failureRun) []string {
			return []string{"prepare", host + "/vms/fail-mf@" + e.memoryFile, "--namespace", "tenant-a"}
		}},
	}
}

func checkpointArgs(t *testing.T, e *failureEnv, host string, r *failureRun) []string {
	r.vm = qmptest.NewFakeQEMU(t, "running", randomBytes(t, 1<<20)) // new chunks: they must be uploaded
	return []string{"checkpoint", "--qmp", r.vm.Path(), "--image", host + "/vms/fail:" + r.tag,
		"--disk", e.overlay, "--disk-image", host + "/vms/fail-disk:" + r.tag, "--chunk-size", "262144"}
}

func TestRegistryFailuresGetTheirCodes(t *testing.T) {
	t.Parallel()
	e := newFailureEnv(t)
	var runs []*failureRun
	for i, f := range registryFaults() {
		for j, c := range failureCommands() {
			r := &failureRun{cmd: c, fault: f, dir: t.TempDir(), tag: "failed-" + string(rune('a'+i)) + string(rune('a'+j))}
			r.args = append(c.args(t, e, e.hosts[f.name], r), "--json")
			if c.agent {
				r.args = append(r.args, "--agent", "unix://"+e.agentSocket)
			} else {
				r.args = append(r.args, e.regArgs()...)
				if f.blob == stallBlob {
					r.args = append(r.args, "--timeout", cliStallTimeout.String())
				}
			}
			runs = append(runs, r)
		}
	}
	runAll(t, runs)
	for _, r := range runs {
		t.Run(r.cmd.name+"/"+r.fault.name, func(t *testing.T) { r.assert(t, e) })
	}
	if logged, _ := exec.Command("grep", "-c", "recovered from a bug", e.agentLog.Name()).Output(); string(bytes.TrimSpace(logged)) != "0" {
		t.Errorf("the agent recovered from bugs while it ran the table (%s times): see its log %s", bytes.TrimSpace(logged), e.agentLog.Name())
	}
}

// cliStallTimeout is the --timeout of a CLI run against a registry that
// stalls: below a registry request's own deadline (20 s), so that the
// command's timeout ends it.
const cliStallTimeout = 10 * time.Second

// runAll runs the binary for every run, several at a time: most of a run
// is waiting for a registry that does not answer, or between retries.
func runAll(t *testing.T, runs []*failureRun) {
	bin := binary(t)
	sem := make(chan struct{}, 12)
	var wg sync.WaitGroup
	for _, r := range runs {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			var stdout, stderr bytes.Buffer
			cmd := exec.CommandContext(ctx, bin, r.args...)
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			start := time.Now()
			err := cmd.Run()
			r.took = time.Since(start)
			r.stdout, r.stderr, r.exit = stdout.Bytes(), stderr.Bytes(), -1
			if cmd.ProcessState != nil {
				r.exit = cmd.ProcessState.ExitCode()
			}
			if err != nil && r.exit <= 0 {
				r.stderr = append(r.stderr, []byte("\nrunning the binary: "+err.Error())...)
			}
		})
	}
	wg.Wait()
}

func (r *failureRun) assert(t *testing.T, e *failureEnv) {
	t.Logf("vmsnap %s\n-> exit %d after %v\nstderr: %s\nstdout: %s", strings.Join(r.args, " "), r.exit, r.took.Round(time.Millisecond), r.stderr, r.stdout)
	for _, s := range []string{"panic", "goroutine", "runtime error"} {
		if bytes.Contains(r.stderr, []byte(s)) || bytes.Contains(r.stdout, []byte(s)) {
			t.Fatalf("the output holds %q", s)
		}
	}
	want := expectedFailure(r.cmd, r.fault)
	if want.code == "" {
		if r.exit != 0 {
			t.Fatalf("exit %d: this fault does not concern the command, which must succeed", r.exit)
		}
		return
	}
	var doc api.ErrorDoc
	if err := json.Unmarshal(r.stdout, &doc); err != nil || doc.Error.Code == "" {
		t.Fatalf("no JSON error object on stdout: %v", err)
	}
	if doc.Error.Code != want.code || r.exit != want.code.ExitStatus() {
		t.Fatalf("%s (exit %d), want %s (exit %d)", doc.Error.Code, r.exit, want.code, want.code.ExitStatus())
	}
	for _, s := range want.says {
		if !strings.Contains(doc.Error.Message, s) {
			t.Errorf("the message does not say %q", s)
		}
	}
	lines := strings.Split(strings.TrimSuffix(string(r.stderr), "\n"), "\n")
	if last := lines[len(lines)-1]; !strings.HasPrefix(last, "vmsnap: "+string(want.code)+": ") || len(lines) > 1 && !r.cmd.agent {
		t.Errorf("stderr is not one line with the code")
	}
	if r.cmd.check != nil {
		r.cmd.check(t, e, r)
	}
}

func checkVMRunsAndNoTag(t *testing.T, e *failureEnv, r *failureRun) {
	if st := r.vm.Status(); st != "running" {
		t.Errorf("the VM is %s after the failed checkpoint, want running", st)
	}
	for _, repo := range []string{"vms/fail", "vms/fail-disk"} {
		if slices.Contains(e.reg.Tags(t, repo), r.tag) {
			t.Errorf("the failed checkpoint tagged %s:%s", repo, r.tag)
		}
	}
}

func checkNotLoaded(t *testing.T, e *failureEnv, r *failureRun) {
	if st := r.vm.Status(); st == "running" {
		t.Errorf("the target QEMU runs after a failed restore")
	}
}

func checkNothingLeft(t *testing.T, e *failureEnv, r *failureRun) {
	if n, _ := countFiles(r.dir); n > 0 {
		t.Errorf("%d files left in %s: %v", n, r.dir, tempFiles(t, r.dir))
	}
}

// expected is what a run must end with: its code, and words of the
// message that say what happened and what to do.
type expected struct {
	code errcode.Code
	says []string
}

func expectedFailure(c failureCommand, f registryFault) expected {
	reads := c.name != "checkpoint" && c.name != "agent checkpoint"
	switch f.name {
	case "connection refused":
		return expected{errcode.RegistryError, []string{"connection refused", "gave up after 4 tries", "check that the registry runs at that address"}}
	case "DNS failure":
		return expected{errcode.RegistryError, []string{"cannot find registry registry.invalid:5000", "check the registry's name"}}
	case "not HTTP":
		return expected{errcode.RegistryError, []string{"does not answer as a registry", "check the registry's address and port"}}
	case "TLS unknown CA":
		return expected{errcode.RegistryError, []string{"cannot verify the TLS certificate", "pass the CA's certificate with --ca-file"}}
	case "401", "403":
		return expected{errcode.AuthFailed, []string{"refused access to vms/fail", "check the credentials"}}
	case "404":
		switch {
		case c.name == "prune":
			return expected{} // a repository the registry does not know has nothing to prune
		case c.name == "inspect":
			return expected{errcode.RegistryError, []string{"no tag t in"}}
		case reads:
			return expected{errcode.RegistryError, []string{"no manifest sha256:", "check the digest"}}
		}
		return expected{errcode.RegistryError, []string{"404 Not Found", "check the registry, the repository and the reference"}}
	case "429":
		return expected{errcode.RegistryError, []string{"429 Too Many Requests", "gave up after 4 tries", "try again later"}}
	case "429 Retry-After 3600":
		return expected{errcode.RegistryError, []string{"429 Too Many Requests", "asks to be asked again in 1h0m0s: try again then"}}
	case "500":
		return expected{errcode.RegistryError, []string{"500 Internal Server Error", "gave up after 4 tries", "try again later"}}
	case "503 Retry-After 1":
		return expected{errcode.RegistryError, []string{"503 Service Unavailable", "gave up after 4 tries", "try again later"}}
	}
	if c.name == "prune" {
		return expected{} // prune reads manifests, never a blob
	}
	switch f.name {
	case "stall mid-blob":
		if c.agent {
			return expected{errcode.RegistryError, []string{"--operation-timeout of 30s", "had not answered"}}
		}
		return expected{errcode.RegistryError, []string{"--timeout of 10s ran out", "waiting for the registry"}}
	case "truncated blob":
		if reads {
			return expected{errcode.DigestMismatch, []string{"does not match its digest", "push the image again"}}
		}
		return expected{errcode.DigestMismatch, []string{"the registry received", "does not match its digest", "try again"}}
	case "cut mid-blob":
		return expected{errcode.RegistryError, []string{"closed the connection mid-transfer", "gave up after 4 tries"}}
	}
	return expected{code: "a fault without an expectation"}
}
