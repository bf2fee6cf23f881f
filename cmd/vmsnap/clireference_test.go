package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// The CLI reference, docs/cli.md, is rendered from the commands themselves
// so that it cannot drift from them: this test fails when the checked-in
// page differs from what the commands say, and -update rewrites it.
var updateCLIReference = flag.Bool("update", false, "rewrite docs/cli.md from the commands")

const cliReferencePath = "../../docs/cli.md"

func TestCLIReference(t *testing.T) {
	got := renderCLIReference(newRootCmd(&globalOutput{stdout: io.Discard, stderr: io.Discard}))
	if *updateCLIReference {
		if err := os.WriteFile(cliReferencePath, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(cliReferencePath)
	if err != nil {
		t.Fatalf("%v: run go test ./cmd/vmsnap -run TestCLIReference -update", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s differs from the commands' help (first difference at line %d): "+
			"run go test ./cmd/vmsnap -run TestCLIReference -update and commit it",
			filepath.Base(cliReferencePath), firstDifferentLine(got, want))
	}
}

// TestCLIReferenceCoversEveryCommand keeps the renderer honest: every
// command a user can call has a section, and the machine's own values
// (its user id, CPUs, memory) never reach the page.
func TestCLIReferenceCoversEveryCommand(t *testing.T) {
	root := newRootCmd(&globalOutput{stdout: io.Discard, stderr: io.Discard})
	page := string(renderCLIReference(root))
	for _, c := range documentedCommands(root) {
		if !strings.Contains(page, "\n## "+c.CommandPath()+"\n") {
			t.Errorf("no section for %q", c.CommandPath())
		}
	}
	if n := len(documentedCommands(root)); n < 10 {
		t.Errorf("only %d commands rendered", n)
	}
	if uid := fmt.Sprintf("vmsnap-%d/", os.Getuid()); os.Getuid() != 0 && strings.Contains(page, uid) {
		t.Errorf("the page holds this user's id (%s)", uid)
	}
	if strings.Contains(page, "(default /dev/termination-log)") || strings.Contains(page, `(default "/dev/termination-log")`) {
		t.Error("the page depends on whether /dev/termination-log exists")
	}
}

func firstDifferentLine(a, b []byte) int {
	la, lb := strings.Split(string(a), "\n"), strings.Split(string(b), "\n")
	for i := range min(len(la), len(lb)) {
		if la[i] != lb[i] {
			return i + 1
		}
	}
	return min(len(la), len(lb)) + 1
}

// documentedCommands is every command --help lists, depth first: hidden
// ones (run by vmsnap itself) and cobra's help command left out.
func documentedCommands(c *cobra.Command) []*cobra.Command {
	cmds := []*cobra.Command{c}
	for _, sub := range c.Commands() {
		if sub.IsAvailableCommand() {
			cmds = append(cmds, documentedCommands(sub)...)
		}
	}
	return cmds
}

func renderCLIReference(root *cobra.Command) []byte {
	var b bytes.Buffer
	b.WriteString("# CLI reference\n\n")
	b.WriteString("Every command's `--help`, generated from the commands by\n" +
		"`go test ./cmd/vmsnap -run TestCLIReference -update`; `make test` fails when\n" +
		"this page and the commands differ. Defaults that depend on the machine are\n" +
		"written as the help describes them (`UID` is the user's id).\n\n")
	cmds := documentedCommands(root)
	for _, c := range cmds {
		fmt.Fprintf(&b, "- [%s](#%s): %s\n", c.CommandPath(), strings.ReplaceAll(c.CommandPath(), " ", "-"), c.Short)
	}
	for _, c := range cmds {
		stableDefaults(c)
		fmt.Fprintf(&b, "\n## %s\n\n%s.\n\n```text\n", c.CommandPath(), strings.TrimSuffix(c.Short, "."))
		if c.Long != "" {
			b.WriteString(strings.TrimSpace(c.Long) + "\n\n")
		}
		b.WriteString(strings.TrimRight(c.UsageString(), "\n") + "\n```\n")
	}
	return b.Bytes()
}

// stableDefaults replaces the defaults a command computes from the machine
// it runs on by what they mean, so that the page is the same everywhere.
func stableDefaults(c *cobra.Command) {
	uid := fmt.Sprintf("vmsnap-%d/", os.Getuid())
	fix := func(f *pflag.Flag) {
		switch f.Name {
		case "termination-log", "max-guest-memory", "max-workers":
			// Their usage says what the default is: the file when it
			// exists, this node's memory, twice the CPUs.
			if f.Value.Type() == "string" {
				f.DefValue = ""
			} else {
				f.DefValue = "0"
			}
		}
		f.DefValue = strings.ReplaceAll(f.DefValue, uid, "vmsnap-UID/")
	}
	c.Flags().VisitAll(fix)
	c.PersistentFlags().VisitAll(fix)
}
