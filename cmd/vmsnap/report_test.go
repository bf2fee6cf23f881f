package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// runRoot runs root as the CLI runs its commands, and returns the exit
// status, stdout and stderr.
func runRoot(root func(*globalOutput) *cobra.Command, args ...string) (int, string, string) {
	var stdout, stderr bytes.Buffer
	out := &globalOutput{stdout: &stdout, stderr: &stderr}
	status := execute(context.Background(), root(out), out, args)
	return status, stdout.String(), stderr.String()
}

// withCommand is the CLI's root command plus one more.
func withCommand(c *cobra.Command) func(*globalOutput) *cobra.Command {
	return func(out *globalOutput) *cobra.Command {
		root := newRootCmd(out)
		addOutputFlags(c, out, false)
		root.AddCommand(c)
		return root
	}
}

// A command that panics ends as INTERNAL, reported like any error: one
// line on stderr, the JSON object with --json, no stack trace.
func TestPanicInACommandIsInternal(t *testing.T) {
	for name, boom := range map[string]func(){
		//lint:ignore SA5000 the write to a nil map is the panic under test
		"a nil map": func() { var m map[string]int; m["x"] = 1 },
		"an error":  func() { panic(errors.New("something impossible")) },
		"nil deref": func() { var e *api.Error; _ = e.Message },
		"a value":   func() { panic(42) },
	} {
		t.Run(name, func(t *testing.T) {
			cmd := &cobra.Command{Use: "boom", RunE: func(*cobra.Command, []string) error { boom(); return nil }}
			status, stdout, stderr := runRoot(withCommand(cmd), "boom", "--json")
			var doc api.ErrorDoc
			if err := json.Unmarshal([]byte(stdout), &doc); err != nil {
				t.Fatalf("no JSON error object: %v\n%s", err, stdout)
			}
			if doc.Error.Code != errcode.Internal || status != errcode.Internal.ExitStatus() {
				t.Fatalf("%s (exit %d), want INTERNAL (exit 1): %s", doc.Error.Code, status, doc.Error.Message)
			}
			if !strings.HasPrefix(stderr, "vmsnap: INTERNAL: ") || strings.Count(stderr, "\n") != 1 {
				t.Fatalf("stderr is not one line with the code: %q", stderr)
			}
			if strings.Contains(stderr+stdout, "panic") || strings.Contains(stderr+stdout, "goroutine") {
				t.Fatalf("the report shows the panic: %s%s", stderr, stdout)
			}
			if !strings.Contains(doc.Error.Message, "report_test.go:") || !strings.Contains(doc.Error.Message, "this is a bug in vmsnap; please report it") {
				t.Fatalf("the message does not say where and what to do: %s", doc.Error.Message)
			}
		})
	}
}

// panicky is an error whose Error method panics: describing it must not.
type panicky struct{}

func (panicky) Error() string { panic("Error method") }

// Errors that cannot be described, or that hold what == cannot compare,
// are still reported with a code.
func TestReportErrorOfAwkwardErrors(t *testing.T) {
	multi := uncomparable{errors.New("a"), errors.New("b")}
	for name, c := range map[string]struct {
		err  error
		want errcode.Code
	}{
		"uncomparable in a chain": {errcode.Wrap(errcode.RegistryError, fmt.Errorf("x: %w", multi), "cannot reach r"), errcode.RegistryError},
		"joined":                  {errors.Join(errcode.New(errcode.AuthFailed, "no"), multi), errcode.AuthFailed},
		"an Error that panics":    {errcode.Wrap(errcode.RegistryError, panicky{}, "outer"), errcode.Internal},
		"unknown agent code":      {&api.Error{Code: "NEWER_CODE", Message: "from a newer agent"}, errcode.Internal},
	} {
		t.Run(name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			status := reportError(&globalOutput{stdout: &stdout, stderr: &stderr}, []string{"--json"}, c.err)
			var doc api.ErrorDoc
			if err := json.Unmarshal(stdout.Bytes(), &doc); err != nil {
				t.Fatalf("no JSON error object: %v\n%s", err, stdout.String())
			}
			if doc.Error.Code != c.want || status != c.want.ExitStatus() {
				t.Fatalf("%s (exit %d), want %s: %s", doc.Error.Code, status, c.want, doc.Error.Message)
			}
			if strings.Count(stderr.String(), "\n") != 1 {
				t.Fatalf("stderr is not one line: %q", stderr.String())
			}
		})
	}
}

// uncomparable is an error == cannot compare (a slice), like
// go-containerregistry's transport.multierrs.
type uncomparable []error

func (u uncomparable) Error() string { return errors.Join(u...).Error() }
