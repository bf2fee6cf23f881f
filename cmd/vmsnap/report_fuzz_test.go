package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// FuzzErrorRendering builds arbitrary errors (nested, joined, wrapped, of
// types == cannot compare, with Error methods that panic, with fields to
// rename, from the agent) and reports each as the CLI does and as the agent
// answers it: neither panics, and both give a code vmsnap knows with its
// exit status or HTTP status.
func FuzzErrorRendering(f *testing.F) {
	for _, seed := range [][]byte{
		{opWrap, 8, opRefusals, opMulti, opText, 'a', opText, 'b'}, // the registry client's unreachable error
		{opJoin, opCoded, 2, opAgent, 5},
		{opTwo, opMulti, opField, 1, opField, 3, opPanicky},
		{opEnsure, 4, opValue, opSlice, opTypedNil},
		{opMap, opErrno, 2, opCanceled},
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		err, _ := buildError(b, 0)
		if err == nil {
			err = errors.New("no error built")
		}
		renderAsCLI(t, err)
		renderAsCLI(t, fromAgent(err))
		renderAsAgent(t, err)
	})
}

func renderAsCLI(t *testing.T, err error) {
	var stdout, stderr bytes.Buffer
	status := reportError(&globalOutput{stdout: &stdout, stderr: &stderr}, []string{"--json"}, err)
	var doc api.ErrorDoc
	if jerr := json.Unmarshal(stdout.Bytes(), &doc); jerr != nil {
		t.Fatalf("no JSON error object: %v: %q", jerr, stdout.String())
	}
	c := doc.Error.Code
	if !slices.Contains(errcode.Codes, c) || status != c.ExitStatus() {
		t.Fatalf("code %q, exit %d", c, status)
	}
	line := stderr.String()
	if !strings.HasPrefix(line, "vmsnap: "+string(c)+": ") || strings.Count(line, "\n") != 1 || strings.Contains(line, "goroutine ") {
		t.Fatalf("stderr %q", line)
	}
}

func renderAsAgent(t *testing.T, err error) {
	status, doc := agent.ErrorResponse(err)
	if !slices.Contains(errcode.Codes, doc.Error.Code) || status != agent.HTTPStatus(doc.Error.Code) {
		t.Fatalf("code %q, status %d", doc.Error.Code, status)
	}
	if _, jerr := json.Marshal(doc); jerr != nil {
		t.Fatal(jerr)
	}
	// What the agent sent, as the CLI reads it.
	sent := doc.Error
	renderAsCLI(t, &sent)
}

// The shapes buildError knows; each byte of the input picks one.
const (
	opText     = iota // a plain error; its text is the next byte
	opCoded           // an *errcode.Error; its code is the next byte
	opField           // an *errcode.Error naming a field; the next byte picks it
	opAgent           // an error that came from the agent; the next byte picks its code, maybe unknown
	opErrno           // a syscall error in a *net.OpError or *os.PathError; the next byte picks it
	opCanceled        // context.Canceled
	opTypedNil        // a nil *errcode.Error
	opPanicky         // an error whose Error method panics
	opWrap            // errcode.Wrap of the next error; the next byte picks the code
	opEnsure          // errcode.Ensure of the next error
	opFmt             // fmt.Errorf %w of the next error
	opTwo             // fmt.Errorf with two %w
	opJoin            // errors.Join of the next two
	opMulti           // a slice of the next two (== cannot compare it), without Unwrap
	opSlice           // a slice of the next two with Unwrap() []error
	opMap             // a map of the next two with Unwrap() []error
	opValue           // a comparable struct holding the next error
	opRefusals        // a struct holding the next error and a slice
	opDetails         // an *errcode.Error with details, wrapping the next
	nOps
)

// maxDepth bounds the tree: errors.As walks it.
const maxDepth = 12

// buildError makes the error b describes and returns what is left of b.
//
//lint:ignore ST1008 the error is the value built, not a failure
func buildError(b []byte, depth int) (error, []byte) {
	if len(b) == 0 || depth > maxDepth {
		return errors.New("leaf"), nil
	}
	op, b := b[0]%nOps, b[1:]
	arg := byte(0)
	if len(b) > 0 && (op <= opErrno || op == opWrap || op == opDetails) {
		arg, b = b[0], b[1:]
	}
	code := errcode.Codes[int(arg)%len(errcode.Codes)]
	switch op {
	case opText:
		return fmt.Errorf("text %d", arg), b
	case opCoded:
		return errcode.New(code, "coded %d", arg), b
	case opField:
		fields := []errcode.Field{"caFile", "stagingDir", "diskImage", "keep"}
		return errcode.New(code, "pass %s", fields[int(arg)%len(fields)]), b
	case opAgent:
		c := code
		if arg%3 == 0 {
			c = "A_NEWER_CODE"
		}
		return &api.Error{Code: c, Message: "from the agent: `stagingDir`", Details: []string{"d`keep`"}}, b
	case opErrno:
		errno := []syscall.Errno{syscall.ECONNREFUSED, syscall.ENOSPC, syscall.EDQUOT, syscall.ECONNRESET}[int(arg)%4]
		if arg%2 == 0 {
			return &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", errno)}, b
		}
		return &os.PathError{Op: "write", Path: "/x/y", Err: errno}, b
	case opCanceled:
		return context.Canceled, b
	case opTypedNil:
		return (*errcode.Error)(nil), b
	case opPanicky:
		return panicky{}, b
	}
	inner, b := buildError(b, depth+1)
	switch op {
	case opWrap:
		return errcode.Wrap(code, inner, "wrapped with %s", errcode.Field("insecureRegistry")), b
	case opEnsure:
		return errcode.Ensure(errcode.RegistryError, inner, "ensured"), b
	case opFmt:
		return fmt.Errorf("fmt: %w", inner), b
	case opValue:
		return valueHolder{inner}, b
	case opRefusals:
		return refusals{inner, []string{"refusing plain HTTP"}}, b
	case opDetails:
		e := errcode.WithDetails(code, []string{"one", "two `keep`"}, "with details").(*errcode.Error)
		e.Err = inner
		return e, b
	}
	other, b := buildError(b, depth+1)
	switch op {
	case opTwo:
		return fmt.Errorf("%w and %w", inner, other), b
	case opJoin:
		return errors.Join(inner, other), b
	case opMulti:
		return uncomparable{inner, other}, b
	case opSlice:
		return unwrapSlice{inner, other}, b
	}
	return unwrapMap{"a": inner, "b": other}, b
}

// unwrapSlice is a slice of errors that says what it holds.
type unwrapSlice []error

func (u unwrapSlice) Error() string   { return errors.Join(u...).Error() }
func (u unwrapSlice) Unwrap() []error { return u }

// unwrapMap is a map of errors: neither == nor a map key.
type unwrapMap map[string]error

func (u unwrapMap) Error() string { return errors.Join(u.Unwrap()...).Error() }
func (u unwrapMap) Unwrap() []error {
	return []error{u["a"], u["b"]}
}

// valueHolder is a struct that == compares by what it holds.
type valueHolder struct{ err error }

func (v valueHolder) Error() string { return "holding: " + v.err.Error() }
func (v valueHolder) Unwrap() error { return v.err }

// refusals is a struct == cannot compare (it holds a slice), like
// ociimage's withoutRefusals around go-containerregistry's multierrs.
type refusals struct {
	err   error
	drops []string
}

func (r refusals) Error() string { return r.err.Error() + " (" + strings.Join(r.drops, ", ") + ")" }
func (r refusals) Unwrap() error { return r.err }
