// Command vmsnap checkpoints a running QEMU VM into OCI images and restores
// it, possibly on another node. It is a thin layer over the operations in
// internal/snapshot (run in this process, or by the node agent with
// --agent) and the agent's daemon: flags in, JSON out, error codes as exit
// statuses. It holds flags and their hints, never an operation's logic.
// Every command's --help is docs/cli.md, which TestCLIReference keeps equal
// to the commands.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
	"unicode"

	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/internal/errcode"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// globalOutput is what every command shares about how it reports.
type globalOutput struct {
	json           bool
	terminationLog string
	stdout, stderr io.Writer
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	out := &globalOutput{stdout: stdout, stderr: stderr}
	return execute(ctx, newRootCmd(out), out, args)
}

// execute runs the command args name and reports its error, if any; it
// returns the exit status. A panic anywhere in the command's goroutine
// ends it as INTERNAL, reported like any error: never a stack trace on the
// user's terminal. (Whatever the command had stopped is put back by the
// deferred calls that ran while the panic unwound: a checkpoint continues
// its VM, see vmstate's sourceGuard.)
func execute(ctx context.Context, root *cobra.Command, out *globalOutput, args []string) (status int) {
	defer func() {
		if v := recover(); v != nil {
			status = reportError(out, args, errcode.Recovered(v))
		}
	}()
	root.SetArgs(args)
	root.SetOut(out.stdout)
	root.SetErr(out.stderr)
	start := time.Now()
	cmd, err := root.ExecuteContextC(ctx)
	if err == nil {
		return 0
	}
	if !errcode.Has(err) {
		// Only cobra's own parsing returns uncoded errors: every command
		// wraps what it returns.
		err = errcode.New(errcode.Usage, "%v (see vmsnap --help)", err)
	}
	return reportError(out, args, explainTimeout(cmd, err, time.Since(start)))
}

// report prints a command's result: JSON with --json, text otherwise, and
// the JSON to the termination log when one is set.
func report(out *globalOutput, doc any, text func(io.Writer)) {
	if out.json {
		writeJSON(out.stdout, doc)
	} else {
		text(out.stdout)
	}
	writeTerminationLog(out, doc)
}

func writeJSON(w io.Writer, v any) {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// defaultTerminationLog is where Kubernetes reads a container's
// termination message; it is used when it exists and no --termination-log
// is given.
const defaultTerminationLog = "/dev/termination-log"

func writeTerminationLog(out *globalOutput, doc any) {
	if out.terminationLog == "" {
		return
	}
	b, _ := json.Marshal(doc)
	if err := os.WriteFile(out.terminationLog, append(b, '\n'), 0o644); err != nil {
		fmt.Fprintf(out.stderr, "vmsnap: warning: could not write the termination log %s: %v\n", out.terminationLog, err)
	}
}

func newRootCmd(out *globalOutput) *cobra.Command {
	root := &cobra.Command{
		Use:   "vmsnap",
		Short: "Checkpoint a running QEMU VM into OCI images and restore it",
		Long: `vmsnap checkpoints a running QEMU VM (memory, vCPU and device state, and its
writable qcow2 disk overlay) into OCI images pinned by digest, and restores it
into a fresh QEMU, on this node or another.

Image references:
  oci:DIR[:TAG]            an OCI image layout on local disk (no registry needed)
  oci:DIR@sha256:HEX       the same, pinned by digest
  HOST[:PORT]/REPO[:TAG]   a registry repository (or ...@sha256:HEX)

A typical round trip:
  vmsnap checkpoint --qmp /run/vm/qmp.sock --image oci:/snap:vm1 \
      --disk /vm/overlay.qcow2 --disk-image oci:/snap:vm1-disk --json
  vmsnap restore --disk-image oci:/snap@sha256:... --disk /new/overlay.qcow2
  qemu-system-x86_64 ...same options... -incoming defer &
  vmsnap restore --qmp /run/new/qmp.sock --image oci:/snap@sha256:...

A VM whose RAM is a shared file (memory-backend-file,share=on) resumes without
loading its memory: vmsnap prepare REF@sha256:... prints the QEMU arguments
that map the snapshot's RAM file; start QEMU with them and -incoming defer,
then vmsnap restore --qmp as above (see vmsnap prepare --help).

Exit status: 0 on success, otherwise the error code's status (see
docs/errors-and-guarantees.md).`,
		SilenceErrors:     true,
		SilenceUsage:      true,
		Version:           version,
		CompletionOptions: cobra.CompletionOptions{DisableDefaultCmd: true},
	}
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return errcode.New(errcode.Usage, "%v (see %s --help)", err, c.CommandPath())
	})
	root.AddCommand(newCheckpointCmd(out), newRestoreCmd(out), newInspectCmd(out), newStreamCmd(), newContinueCmd(), newLoadCmd(),
		newAgentCmd(out), newMounterCmd(), newManifestsCmd(out), newPruneCmd(out), newLaunchCmd(out), newPrepareCmd(out))
	return root
}

// addOutputFlags registers the flags every command has for its result.
func addOutputFlags(c *cobra.Command, out *globalOutput, termLog bool) {
	c.Flags().BoolVar(&out.json, "json", false, "print the result (or the error) as one JSON object on stdout")
	if termLog {
		def := ""
		if _, err := os.Stat(defaultTerminationLog); err == nil {
			def = defaultTerminationLog
		}
		c.Flags().StringVar(&out.terminationLog, "termination-log", def,
			"also write the result (or error) JSON to this file, for a controller to read from the pod's status (default "+defaultTerminationLog+" when it exists)")
	}
}

// explainTimeout says so when a command's own --timeout ended it: it ran
// for that long and failed on a deadline. The error keeps the code of what
// was interrupted (REGISTRY_ERROR for a push the registry did not answer,
// QMP_ERROR for a QEMU that did not); the message adds that the overall
// time ran out and what to do.
func explainTimeout(c *cobra.Command, err error, took time.Duration) error {
	if c == nil || !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	f := c.Flags().Lookup("timeout")
	if f == nil {
		return err
	}
	limit, perr := time.ParseDuration(f.Value.String())
	if perr != nil || took < limit {
		return err // a deadline of its own, inside the command
	}
	advice := "give it more time with --timeout if it needs longer"
	switch errcode.Of(err) {
	case errcode.RegistryError, errcode.AuthFailed:
		advice = "it was waiting for the registry: if that is only slow, give it more time with --timeout, otherwise find out why the registry does not answer"
	case errcode.QMPError, errcode.VMNotFound, errcode.Busy:
		advice = "it was waiting for QEMU: if that is only slow, give it more time with --timeout, otherwise find out why QEMU does not answer"
	}
	return errcode.Wrap(errcode.Of(err), err, "%s gave up when its --timeout of %v ran out (%s)", c.CommandPath(), limit, advice)
}

// coded makes sure every error a command returns has a code, so that run
// can tell them from cobra's parsing errors.
func coded(err error) error {
	return errcode.Ensure(errcode.Internal, err, "%s", "unexpected failure")
}

// flagOf is the flag that sets a request field the libraries name in their
// errors: the field's API name in kebab case (stagingDir: --staging-dir).
func flagOf(f errcode.Field) string {
	var b strings.Builder
	b.WriteString("--")
	for _, r := range string(f) {
		if unicode.IsUpper(r) {
			b.WriteByte('-')
			r = unicode.ToLower(r)
		}
		b.WriteRune(r)
	}
	return b.String()
}
