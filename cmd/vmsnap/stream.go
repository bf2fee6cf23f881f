package main

import (
	"context"
	"os"

	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/internal/errcode"
)

func newStreamCmd() *cobra.Command {
	var dir string
	var stream streamFlags
	c := &cobra.Command{
		Use:   "stream --dir DIR",
		Short: "Write a staged snapshot's raw VM state to stdout, for QEMU's -incoming exec:",
		Long: `Write the VM state that "vmsnap restore --to-dir DIR" staged to stdout, verifying
every chunk against its digest again on the way, so that QEMU can load it with

  qemu-system-x86_64 ...same options as the source... -incoming "exec:vmsnap stream --dir DIR"

Nothing but the raw migration stream is written to stdout; errors go to
stderr (QEMU's log). A chunk that fails verification ends the stream early,
which makes QEMU fail the load rather than run a damaged guest.

This path cannot compare the waiting QEMU with the recorded VM before it
loads: prefer "vmsnap restore --qmp SOCK" into a QEMU started with
-incoming defer where the agent or a script can reach the monitor.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			return coded(runStream(c.Context(), dir, stream))
		},
	}
	c.Flags().StringVar(&dir, "dir", "", "the directory restore --to-dir staged the snapshot in (required)")
	stream.add(c)
	return c
}

func runStream(ctx context.Context, dir string, f streamFlags) error {
	if dir == "" {
		return errcode.New(errcode.Usage, "stream needs --dir DIR (where restore --to-dir staged the snapshot)")
	}
	return agent.StreamStaged(ctx, dir, os.Stdout, f.options())
}
