package main

import (
	"fmt"
	"testing"

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
