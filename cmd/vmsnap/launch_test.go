package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// fakeExec records what vmsnap launch would exec instead of doing it.
func fakeExec(t *testing.T) *[][]string {
	t.Helper()
	var calls [][]string
	old := execQEMU
	execQEMU = func(argv0 string, argv, env []string) error {
		calls = append(calls, append([]string{argv0}, argv...))
		return nil
	}
	t.Cleanup(func() { execQEMU = old })
	return &calls
}

func launchCLI(t *testing.T, args ...string) (stderr string, code int) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(context.Background(), append([]string{"launch"}, args...), &out, &errb)
	t.Logf("vmsnap launch %s -> exit %d\n%s%s", strings.Join(args, " "), code, errb.String(), out.String())
	return errb.String(), code
}

func TestLaunchRefusesBadCommandLines(t *testing.T) {
	calls := fakeExec(t)
	markers := t.TempDir()
	for name, args := range map[string][]string{
		"no marker dir":      {"--defer", "--", "/bin/true"},
		"neither mode":       {"--marker-dir", markers, "--", "/bin/true"},
		"both modes":         {"--marker-dir", markers, "--defer", "--state-dir", "/vm/state", "--qmp", "/vm/run/q", "--", "/bin/true"},
		"state without qmp":  {"--marker-dir", markers, "--state-dir", "/vm/state", "--", "/bin/true"},
		"user's -incoming":   {"--marker-dir", markers, "--defer", "--", "/bin/true", "-m", "256", "-incoming", "defer"},
		"user's --incoming=": {"--marker-dir", markers, "--defer", "--", "/bin/true", "--incoming=tcp:0:4444"},
		"bad on-restart":     {"--marker-dir", markers, "--defer", "--on-restart", "reload", "--", "/bin/true"},
		"no QEMU":            {"--marker-dir", markers, "--defer", "--"},
		"no dash":            {"--marker-dir", markers, "--defer", "/bin/true"},
		"shell character":    {"--marker-dir", markers, "--state-dir", "/vm/state;reboot", "--qmp", "/vm/run/q", "--", "/bin/true", "-qmp", "unix:/vm/run/q"},
		"relative state dir": {"--marker-dir", markers, "--state-dir", "vm/state", "--qmp", "/vm/run/q", "--", "/bin/true", "-qmp", "unix:/vm/run/q"},
		"qmp with defer":     {"--marker-dir", markers, "--defer", "--qmp", "/vm/run/q", "--", "/bin/true"},
	} {
		if _, code := launchCLI(t, args...); code != errcode.Usage.ExitStatus() {
			t.Errorf("%s: exit %d, want USAGE (%d)", name, code, errcode.Usage.ExitStatus())
		}
	}
	// A state directory the init container staged nothing in.
	empty := t.TempDir()
	stderr, code := launchCLI(t, "--marker-dir", markers, "--state-dir", empty, "--qmp", "/vm/run/q", "--", "/bin/true", "-qmp", "unix:/vm/run/q")
	if code != errcode.InvalidInput.ExitStatus() || !strings.Contains(stderr, "no VM state staged in "+empty) {
		t.Errorf("nothing staged: exit %d, %q; want INVALID_INPUT naming the directory", code, stderr)
	}
	if len(*calls) != 0 {
		t.Errorf("QEMU was started for a refused command line: %q", *calls)
	}
	if entries, _ := os.ReadDir(markers); len(entries) != 0 {
		t.Errorf("a refused command line left a marker: %v", entries)
	}
}

// The -incoming defer variant: the first start waits for the agent, a
// restart boots cold or fails; the marker is claimed before QEMU starts.
func TestLaunchDeferOnceThenColdOrFail(t *testing.T) {
	calls := fakeExec(t)
	markers := t.TempDir()
	qemu := []string{"/bin/true", "-machine", "pc", "-m", "256"}

	stderr, code := launchCLI(t, append([]string{"--marker-dir", markers, "--defer", "--"}, qemu...)...)
	if code != 0 || len(*calls) != 1 || !slices.Equal((*calls)[0][1:], append(slices.Clone(qemu), "-incoming", "defer")) {
		t.Fatalf("first start: exit %d, exec %q; want %q + -incoming defer", code, *calls, qemu)
	}
	if _, err := os.Stat(filepath.Join(markers, "loaded-defer")); err != nil || !strings.Contains(stderr, "once (marker") {
		t.Fatalf("first start claimed no marker: %v, %q", err, stderr)
	}

	stderr, code = launchCLI(t, append([]string{"--marker-dir", markers, "--defer", "--"}, qemu...)...)
	if code != 0 || len(*calls) != 2 || !slices.Equal((*calls)[1][1:], qemu) {
		t.Fatalf("restart: exit %d, exec %q; want %q without -incoming", code, (*calls)[1:], qemu)
	}
	if !strings.Contains(stderr, "starting QEMU cold") {
		t.Errorf("the cold start is not logged: %q", stderr)
	}

	stderr, code = launchCLI(t, append([]string{"--marker-dir", markers, "--defer", "--on-restart", "fail", "--"}, qemu...)...)
	if code != errcode.InvalidInput.ExitStatus() || len(*calls) != 2 {
		t.Fatalf("--on-restart fail: exit %d, %d execs; want INVALID_INPUT and no QEMU", code, len(*calls))
	}
	if !strings.Contains(stderr, "loaded in this pod before") || !strings.Contains(stderr, "delete the pod") {
		t.Errorf("the failure does not say why and what to do: %q", stderr)
	}

	// An unwritable marker directory: no claim, no load.
	ro := t.TempDir()
	if err := os.Chmod(ro, 0o555); err != nil {
		t.Fatal(err)
	}
	if os.Geteuid() != 0 {
		if _, code := launchCLI(t, append([]string{"--marker-dir", ro, "--defer", "--"}, qemu...)...); code == 0 || len(*calls) != 2 {
			t.Errorf("an unwritable marker dir: exit %d, %d execs; want a failure and no QEMU", code, len(*calls))
		}
	}
}
