//go:build linux

package e2e

// Registry credentials never show: not in what vmsnap prints (stdout,
// stderr, --json errors, the termination log), not in the argv or the
// environment of a process vmsnap or the test harness starts. The registry
// is the real one (internal/testing/registry: docker-registry with TLS and
// htpasswd); the VM is qmptest's fake QEMU, so the test runs in seconds.

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/testing/registry"
	"github.com/vmsnap/vmsnap/qmp/qmptest"
)

// secretsOf lists the strings that must never appear: the password (the
// wrong one contains it), and the base64 of USER:PASSWORD for both, which
// is what a Basic auth header or a Docker config holds.
func secretsOf(reg *registry.Registry) map[string]string {
	return map[string]string{
		"password":                 reg.Password,
		"base64(user:password)":    base64.StdEncoding.EncodeToString([]byte(reg.User + ":" + reg.Password)),
		"base64(user:wrong)":       base64.StdEncoding.EncodeToString([]byte(reg.User + ":not-" + reg.Password)),
		"base64url(user:password)": base64.URLEncoding.EncodeToString([]byte(reg.User + ":" + reg.Password)),
	}
}

func assertNoSecret(t *testing.T, secrets map[string]string, where string, data []byte) {
	t.Helper()
	for name, s := range secrets {
		if bytes.Contains(data, []byte(s)) {
			t.Errorf("%s holds the %s:\n%s", where, name, data)
		}
	}
}

// runVmsnap runs the built binary with env added and returns stdout, stderr
// and the exit status.
func runVmsnap(t *testing.T, env []string, args ...string) ([]byte, []byte, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary(t), args...)
	cmd.Env = append(os.Environ(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("vmsnap %s: %v", strings.Join(args, " "), err)
	}
	t.Logf("vmsnap %s -> exit %d\nstderr: %s\nstdout: %.2000s", strings.Join(args, " "), code, stderr.Bytes(), stdout.Bytes())
	return stdout.Bytes(), stderr.Bytes(), code
}

func TestSecretsNeverPrintedOrPassedOn(t *testing.T) {
	t.Parallel()
	if os.Getenv("DOCKER_CONFIG") != "" {
		t.Skip("DOCKER_CONFIG is set in the test's environment")
	}
	reg := registry.Start(t)
	secrets := secretsOf(reg)

	// The harness itself: htpasswd got the password on stdin, and the
	// registry runs with neither it nor its hash in argv or environment.
	for _, f := range []string{"cmdline", "environ"} {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(reg.Pid()) + "/" + f)
		if err != nil {
			t.Fatal(err)
		}
		assertNoSecret(t, secrets, "the registry's "+f, b)
	}
	for name, s := range secrets {
		for _, kv := range os.Environ() {
			if strings.Contains(kv, s) {
				t.Fatalf("the test's own environment holds the %s", name)
			}
		}
	}

	vm := qmptest.NewFakeQEMU(t, "running", randomBytes(t, 2<<20))
	image := reg.Host + "/vms/secrets:vm1"
	work := t.TempDir()
	termLog := filepath.Join(work, "termination-log")
	cp := []string{"checkpoint", "--qmp", vm.Path(), "--image", image, "--ca-file", reg.CAFile, "--json", "--termination-log", termLog}

	// A wrong password, from --registry-config and from DOCKER_CONFIG.
	for _, how := range []struct {
		name string
		env  []string
		args []string
	}{
		{"--registry-config", nil, []string{"--registry-config", reg.WrongConfigDir}},
		{"DOCKER_CONFIG", []string{"DOCKER_CONFIG=" + reg.WrongConfigDir}, nil},
	} {
		stdout, stderr, code := runVmsnap(t, how.env, with(cp, how.args...)...)
		var doc api.ErrorDoc
		if err := json.Unmarshal(stdout, &doc); err != nil || doc.Error.Code != errcode.AuthFailed || code != errcode.AuthFailed.ExitStatus() {
			t.Fatalf("wrong password via %s: exit %d, %s", how.name, code, stdout)
		}
		if !strings.Contains(doc.Error.Message, "refused access") || !strings.Contains(doc.Error.Message, reg.WrongConfigDir) {
			t.Fatalf("the AUTH_FAILED message does not say what was refused and which credentials were used: %s", doc.Error.Message)
		}
		tl, err := os.ReadFile(termLog)
		if err != nil {
			t.Fatal(err)
		}
		assertNoSecret(t, secrets, "stdout (wrong password, "+how.name+")", stdout)
		assertNoSecret(t, secrets, "stderr (wrong password, "+how.name+")", stderr)
		assertNoSecret(t, secrets, "the termination log (wrong password)", tl)
	}
	if vm.Status() != "running" {
		t.Fatalf("the VM is %s after refused checkpoints", vm.Status())
	}

	// The right one.
	stdout, stderr, code := runVmsnap(t, nil, with(cp, "--registry-config", reg.ConfigDir)...)
	if code != 0 {
		t.Fatalf("checkpoint: exit %d", code)
	}
	var res api.CheckpointResult
	if err := json.Unmarshal(stdout, &res); err != nil {
		t.Fatal(err)
	}
	tl, _ := os.ReadFile(termLog)
	assertNoSecret(t, secrets, "stdout (checkpoint)", stdout)
	assertNoSecret(t, secrets, "stderr (checkpoint)", stderr)
	assertNoSecret(t, secrets, "the termination log (checkpoint)", tl)

	// Inspect and stage from the registry, credentials from DOCKER_CONFIG.
	env := []string{"DOCKER_CONFIG=" + reg.ConfigDir}
	stdout, stderr, code = runVmsnap(t, env, "inspect", res.VMState.Image, "--ca-file", reg.CAFile)
	if code != 0 {
		t.Fatalf("inspect: exit %d", code)
	}
	assertNoSecret(t, secrets, "inspect's stdout", stdout)
	assertNoSecret(t, secrets, "inspect's stderr", stderr)
	staged := filepath.Join(work, "staged")
	stdout, stderr, code = runVmsnap(t, env, "restore", "--image", res.VMState.Image, "--to-dir", staged, "--ca-file", reg.CAFile, "--json")
	if code != 0 {
		t.Fatalf("restore --to-dir: exit %d", code)
	}
	assertNoSecret(t, secrets, "restore's stdout", stdout)
	assertNoSecret(t, secrets, "restore's stderr", stderr)

	// vmsnap stream --qmp starts `vmsnap continue`: neither its argv nor its
	// environment holds a credential (DOCKER_CONFIG, a path, is inherited).
	qmpPath := filepath.Join(work, "no-qemu-here-"+strconv.Itoa(os.Getpid())+".sock")
	cmd := exec.Command(binary(t), "stream", "--dir", staged, "--qmp", qmpPath)
	cmd.Env = append(os.Environ(), env...)
	// A file, not a pipe: vmsnap continue inherits stream's stderr (QEMU's
	// log) and outlives it, and a pipe would keep Run waiting for it.
	serrFile, err := os.Create(filepath.Join(work, "stream.stderr"))
	if err != nil {
		t.Fatal(err)
	}
	defer serrFile.Close()
	cmd.Stdout, cmd.Stderr = nil, serrFile // stdout: the raw state, to /dev/null
	runErr := cmd.Run()
	serr, _ := os.ReadFile(serrFile.Name())
	if runErr != nil {
		t.Fatalf("stream: %v: %s", runErr, serr)
	}
	assertNoSecret(t, secrets, "stream's stderr", serr)
	pid := findProcess(t, "continue\x00--qmp\x00"+qmpPath)
	defer func() { _ = syscall.Kill(pid, syscall.SIGKILL) }()
	argv, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	var environ []byte
	environ, err = os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
	if err != nil {
		t.Fatal(err)
	}
	assertNoSecret(t, secrets, "vmsnap continue's argv", argv)
	assertNoSecret(t, secrets, "vmsnap continue's environment", environ)
	sawConfig := false
	for _, kv := range strings.Split(string(environ), "\x00") {
		k, v, _ := strings.Cut(kv, "=")
		for name, s := range secrets {
			if v == s {
				t.Errorf("vmsnap continue's %s is the %s", k, name)
			}
		}
		sawConfig = sawConfig || kv == "DOCKER_CONFIG="+reg.ConfigDir
	}
	if !sawConfig {
		t.Fatalf("vmsnap continue's environment was not read (no DOCKER_CONFIG in it): %q", environ)
	}
	t.Logf("checked vmsnap continue (pid %d): argv %q, %d environment variables", pid, strings.ReplaceAll(string(argv), "\x00", " "), strings.Count(string(environ), "\x00"))
}

// findProcess returns the pid of the process whose argv contains needle.
func findProcess(t *testing.T, needle string) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		entries, _ := os.ReadDir("/proc")
		for _, e := range entries {
			pid, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
			if err == nil && bytes.Contains(b, []byte(needle)) {
				return pid
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no process with %q in its argv", needle)
	return 0
}

func randomBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	f, err := os.Open("/dev/urandom")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Read(b[:n/2]); err != nil {
		t.Fatal(err)
	}
	return b
}
