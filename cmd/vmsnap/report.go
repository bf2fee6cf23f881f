package main

import (
	"fmt"
	"slices"
	"strings"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// reportError tells the user about err: one line on stderr, the JSON error
// object on stdout with --json (which args may hold even if parsing them
// failed), and the termination log. It returns the exit status of err's
// code.
func reportError(out *globalOutput, args []string, err error) int {
	line, e := describeError(err)
	fmt.Fprintf(out.stderr, "vmsnap: %s: %s\n", e.Code, line)
	if out.json || slices.Contains(args, "--json") {
		writeJSON(out.stdout, api.ErrorDoc{Error: e})
	}
	// Kubernetes keeps 4096 bytes of a termination message.
	writeTerminationLog(out, api.ErrorDoc{Error: e.Truncated(4096)})
	return e.Code.ExitStatus()
}

// describeError is what the CLI says about err: its text on one line, with
// the libraries' field names written as this CLI's flags, and its JSON
// form. It never panics: an error that cannot be described is INTERNAL.
func describeError(err error) (line string, e api.Error) {
	defer func() {
		if v := recover(); v != nil {
			e = api.ErrorOf(errcode.Recovered(v))
			line = e.Message
		}
	}()
	err = errcode.WithFieldNames(err, flagOf)
	e = api.ErrorOf(err)
	// errors.Join separates with newlines; stderr gets one line.
	return strings.ReplaceAll(err.Error(), "\n", "; "), e
}
