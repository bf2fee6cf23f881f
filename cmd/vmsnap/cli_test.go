package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// Command-line contract tests that need no QEMU.

// cli runs vmsnap in-process with args and returns stdout and the exit
// status. (The end-to-end tests in internal/testing/e2e run the built binary.)
func cli(t testing.TB, args ...string) ([]byte, int) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), args, &stdout, &stderr)
	t.Logf("vmsnap %s -> exit %d\n%s%s", strings.Join(args, " "), code, stderr.String(), stdout.String())
	return stdout.Bytes(), code
}

// cliError runs vmsnap with --json, expects failure with code, and returns
// the error object.
func cliError(t testing.TB, code errcode.Code, args ...string) api.ErrorDoc {
	t.Helper()
	out, exit := cli(t, append(args, "--json")...)
	var doc api.ErrorDoc
	if err := json.Unmarshal(out, &doc); err != nil {
		t.Fatalf("no JSON error object on stdout: %v\n%s", err, out)
	}
	if doc.Error.Code != code || exit != code.ExitStatus() {
		t.Fatalf("got %s (exit %d), want %s (exit %d): %s", doc.Error.Code, exit, code, code.ExitStatus(), doc.Error.Message)
	}
	return doc
}

func TestUsageErrors(t *testing.T) {
	pinned := "oci:/tmp/x@sha256:" + strings.Repeat("a", 64)
	cases := map[string][]string{
		"unknown flag":                       {"checkpoint", "--bogus"},
		"unknown command":                    {"frobnicate"},
		"checkpoint without qmp":             {"checkpoint", "--image", "oci:/tmp/x:t"},
		"disk without disk-image":            {"checkpoint", "--qmp", "/s", "--image", "oci:/tmp/x:t", "--disk", "/d"},
		"bad mode":                           {"checkpoint", "--qmp", "/s", "--image", "oci:/tmp/x:t", "--mode", "fast"},
		"live with disk":                     {"checkpoint", "--qmp", "/s", "--image", "oci:/tmp/x:t", "--mode", "live", "--disk", "/d", "--disk-image", "oci:/tmp/x:d"},
		"restore both forms":                 {"restore", "--qmp", "/s", "--image", pinned, "--disk", "/d", "--disk-image", pinned},
		"restore nothing":                    {"restore"},
		"restore half state":                 {"restore", "--qmp", "/s"},
		"inspect without ref":                {"inspect"},
		"prepare --agent with a cache dir":   {"prepare", "--agent", "unix:///nonexistent.sock", pinned, "--cache-dir", "/tmp/x"},
		"prepare --agent with a cache bound": {"prepare", "--agent", "unix:///nonexistent.sock", pinned, "--max-cache-bytes", "1"},
		"prepare --namespace without agent":  {"prepare", "--namespace", "tenant-a", pinned},
	}
	for name, args := range cases {
		t.Run(name, func(t *testing.T) {
			doc := cliError(t, errcode.Usage, args...)
			if doc.Error.Message == "" {
				t.Fatal("usage error without a message")
			}
		})
	}
}

func TestRestoreRefusesTags(t *testing.T) {
	for _, args := range [][]string{
		{"restore", "--qmp", "/nonexistent.sock", "--image", "oci:/tmp/store:v1"},
		{"restore", "--disk-image", "oci:/tmp/store:v1-disk", "--disk", "/tmp/overlay.qcow2"},
	} {
		doc := cliError(t, errcode.TagNotAllowed, args...)
		if !strings.Contains(doc.Error.Message, "--allow-tag") {
			t.Errorf("the message does not say how to proceed: %s", doc.Error.Message)
		}
	}
	// With --allow-tag the tag is accepted and the next problem surfaces.
	cliError(t, errcode.RegistryError, "restore", "--allow-tag", "--disk-image", "oci:"+t.TempDir()+"/none:v1", "--disk", filepath.Join(t.TempDir(), "o.qcow2"))
}

func TestMissingVMIsVMNotFound(t *testing.T) {
	doc := cliError(t, errcode.VMNotFound, "checkpoint", "--qmp", filepath.Join(t.TempDir(), "no.sock"), "--image", "oci:"+t.TempDir()+":t")
	if !strings.Contains(doc.Error.Message, "-qmp unix:") {
		t.Errorf("the message does not say how QEMU must be started: %s", doc.Error.Message)
	}
}

func TestBadReferenceIsInvalidInput(t *testing.T) {
	cliError(t, errcode.InvalidInput, "inspect", "not a reference")
}

func TestTerminationLogGetsTheErrorToo(t *testing.T) {
	log := filepath.Join(t.TempDir(), "termination-log")
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"checkpoint", "--qmp", "/nonexistent.sock", "--image", "oci:" + t.TempDir() + ":t", "--termination-log", log}, &stdout, &stderr)
	if code != errcode.VMNotFound.ExitStatus() {
		t.Fatalf("exit %d", code)
	}
	if stdout.Len() != 0 {
		t.Fatalf("without --json nothing goes to stdout, got %q", stdout.String())
	}
	if !strings.HasPrefix(stderr.String(), "vmsnap: VM_NOT_FOUND: ") || strings.Count(stderr.String(), "\n") != 1 {
		t.Fatalf("stderr is not one line with the code: %q", stderr.String())
	}
	b, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}
	var doc api.ErrorDoc
	if err := json.Unmarshal(b, &doc); err != nil || doc.Error.Code != errcode.VMNotFound {
		t.Fatalf("termination log %q: %v", b, err)
	}
}

func TestExitStatusesAreDistinct(t *testing.T) {
	seen := map[int]errcode.Code{}
	for _, c := range errcode.Codes {
		s := c.ExitStatus()
		if s == 0 || seen[s] != "" {
			t.Fatalf("%s has exit status %d, taken by %q", c, s, seen[s])
		}
		seen[s] = c
	}
	if len(seen) != 12 || errcode.Forbidden.ExitStatus() != 12 {
		t.Fatalf("%d codes, the contract has 12 (FORBIDDEN is %d, want 12)", len(seen), errcode.Forbidden.ExitStatus())
	}
}

func TestHelpIsComplete(t *testing.T) {
	for _, cmd := range []string{"checkpoint", "restore", "inspect"} {
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), []string{cmd, "--help"}, &stdout, &stderr); code != 0 {
			t.Fatalf("%s --help: exit %d", cmd, code)
		}
		for _, want := range []string{"--json", "Usage:"} {
			if !strings.Contains(stdout.String(), want) {
				t.Errorf("%s --help lacks %q", cmd, want)
			}
		}
	}
}

// --rootfs-image needs the agent; the refusal comes before any store or VM
// is touched, in the words of the flags.
func TestRootfsImageNeedsTheAgent(t *testing.T) {
	doc := cliError(t, errcode.Usage, "checkpoint", "--qmp", "/nonexistent.sock", "--image", "127.0.0.1:1/vms/x:t", "--rootfs-image", "127.0.0.1:1/vms/x:r")
	if want := "--rootfs-image captures a container's writable layer through the node's containerd: use it with --agent"; doc.Error.Message != want {
		t.Fatalf("message %q, want %q", doc.Error.Message, want)
	}
}
