package main

import (
	"fmt"
	"strings"
	"testing"

	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

// The libraries name request fields in their errors; the CLI shows the flag
// that sets each, so its messages read as before the libraries stopped
// naming flags. Every field a library names is listed here.
func TestFlagOfNamesTheFlags(t *testing.T) {
	for field, flag := range map[errcode.Field]string{
		"format": "--format", "stagingDir": "--staging-dir", "insecureRegistry": "--insecure-registry",
		"caFile": "--ca-file", "keep": "--keep", "stateDir": "--state-dir", "dir": "--dir", "toDir": "--to-dir",
		"allowTag": "--allow-tag", "diskImage": "--disk-image", "rootfsImage": "--rootfs-image", "agent": "--agent",
	} {
		if got := flagOf(field); got != flag {
			t.Errorf("flagOf(%s) = %s, want %s", field, got, flag)
		}
	}
	err := fmt.Errorf("%w; the VM was continued", errcode.New(errcode.Internal, "pick another directory with %s", errcode.Field("stagingDir")))
	if got, want := errcode.WithFieldNames(err, flagOf).Error(), "pick another directory with --staging-dir; the VM was continued"; got != want {
		t.Fatalf("CLI text %q, want %q", got, want)
	}
}

// An error from the agent crossed its API as text: the CLI still shows its
// flags where the library named fields, and keeps the code and details.
func TestAgentErrorsNameTheFlags(t *testing.T) {
	lib := errcode.WithDetails(errcode.Usage, []string{fmt.Sprintf("set %s", errcode.Field("stagingDir"))},
		"the disk overlay is on a volume: give it an image reference of its own (%s)", errcode.Field("diskImage"))
	remote := api.ErrorOf(lib) // what the agent sends
	got := fromAgent(&remote)
	if msg := got.Error(); !strings.Contains(msg, "(--disk-image)") || strings.Contains(msg, "diskImage") {
		t.Fatalf("message %q", msg)
	}
	if d := errcode.DetailsOf(got); len(d) != 1 || d[0] != "set --staging-dir" {
		t.Fatalf("details %q", d)
	}
	if errcode.Of(got) != errcode.Usage {
		t.Fatalf("code %s", errcode.Of(got))
	}
	if other := errcode.New(errcode.Internal, "local"); fromAgent(other) != other {
		t.Fatal("a local error was rewritten")
	}
}
