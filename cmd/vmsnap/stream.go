package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/qmp"
	"github.com/vmsnap/vmsnap/vmstate"
)

func newStreamCmd() *cobra.Command {
	var (
		dir, qmpPath string
		paused       bool
		stream       streamFlags
	)
	c := &cobra.Command{
		Use:   "stream --dir DIR",
		Short: "Write a staged snapshot's raw VM state to stdout, for QEMU's -incoming exec:",
		Long: `Write the VM state that "vmsnap restore --to-dir DIR" staged to stdout, verifying
every chunk against its digest again on the way, so that QEMU can load it with

  qemu-system-x86_64 ...same options as the source... -qmp unix:SOCK,server=on,wait=off \
      -incoming "exec:vmsnap stream --dir DIR --qmp SOCK"

With --qmp, once the stream is written it waits for QEMU to load it and
continues the VM (QEMU keeps the run state recorded in the stream, which is
"stopped" for any checkpoint but a live one), or leaves it stopped with
--paused. Without --qmp, the VM stays paused until someone sends "cont".

Nothing but the raw migration stream is written to stdout; errors go to
stderr (QEMU's log). A chunk that fails verification ends the stream early,
which makes QEMU fail the load rather than run a damaged guest.

This path cannot compare the waiting QEMU with the recorded VM before it
loads: prefer "vmsnap restore --qmp SOCK" into a QEMU started with
-incoming defer where the agent or a script can reach the monitor.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			return coded(runStream(c.Context(), dir, qmpPath, paused, stream))
		},
	}
	c.Flags().StringVar(&dir, "dir", "", "the directory restore --to-dir staged the snapshot in (required)")
	c.Flags().StringVar(&qmpPath, "qmp", "", "the loading QEMU's monitor socket: continue the VM once it has loaded the state")
	c.Flags().BoolVar(&paused, "paused", false, "with --qmp: leave the VM stopped once loaded")
	stream.add(c, streamWorkers)
	return c
}

func runStream(ctx context.Context, dir, qmpPath string, paused bool, f streamFlags) error {
	if dir == "" {
		return errcode.New(errcode.Usage, "stream needs --dir DIR (where restore --to-dir staged the snapshot)")
	}
	if paused && qmpPath == "" {
		return errcode.New(errcode.Usage, "--paused needs --qmp SOCK: without it the VM stays as the stream left it")
	}
	if err := snapshot.StreamStaged(ctx, dir, os.Stdout, f.options()); err != nil {
		return err
	}
	if qmpPath == "" {
		return nil
	}
	// QEMU kills its exec: child (SIGTERM, then SIGKILL 10 ms later) as soon
	// as it has read the stream, before the load is even done: the VM is
	// continued by `vmsnap continue` in a session of its own.
	self, err := os.Executable()
	if err != nil {
		return errcode.Wrap(errcode.Internal, err, "finding the vmsnap binary to continue the VM")
	}
	args := []string{"continue", "--qmp", qmpPath}
	if paused {
		args = append(args, "--paused")
	}
	cmd := exec.Command(self, args...)
	cmd.Stderr = os.Stderr // QEMU's log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return errcode.Wrap(errcode.Internal, err, "starting vmsnap continue")
	}
	_ = cmd.Process.Release()
	return nil
}

func newContinueCmd() *cobra.Command {
	var (
		qmpPath string
		paused  bool
		timeout time.Duration
	)
	c := &cobra.Command{
		Use:   "continue --qmp SOCK [--paused]",
		Short: "Wait until QEMU has loaded its incoming state, then continue the VM",
		Long: `Wait until a QEMU loading an incoming migration (started with -incoming) has
finished, then continue the VM, or leave it stopped with --paused. QEMU keeps
the run state recorded in the stream, and a checkpoint stops the VM before it
captures it, so a VM restored by QEMU itself (-incoming "exec:...") stays
paused until something continues it. "vmsnap stream --qmp SOCK" runs this
for you; "vmsnap restore --qmp" does the same on its own.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if qmpPath == "" {
				return errcode.New(errcode.Usage, "continue needs --qmp SOCK")
			}
			ctx, cancel := context.WithTimeout(c.Context(), timeout)
			defer cancel()
			mon, err := dialRetry(ctx, qmpPath)
			if err != nil {
				return err
			}
			defer mon.Close()
			_, err = vmstate.FinishIncoming(ctx, mon, paused)
			return coded(err)
		},
	}
	c.Flags().StringVar(&qmpPath, "qmp", "", "the QEMU monitor's unix socket (required)")
	c.Flags().BoolVar(&paused, "paused", false, "leave the VM stopped once loaded")
	c.Flags().DurationVar(&timeout, "timeout", 10*time.Minute, "give up after this long")
	return c
}

// dialRetry connects to a QEMU monitor that may not listen yet, or may be
// busy with another client for a moment.
func dialRetry(ctx context.Context, path string) (*qmp.Client, error) {
	for {
		dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		mon, err := qmp.Dial(dctx, path)
		cancel()
		if err == nil || ctx.Err() != nil {
			return mon, err
		}
		select {
		case <-time.After(200 * time.Millisecond):
		case <-ctx.Done():
			return nil, err
		}
	}
}

// newLoadCmd is what vmsnap launch starts, detached, for a memory-file
// snapshot: QEMU waits with -incoming defer, and this loads the staged
// device state over its monitor as restore --qmp does (compatibility and
// the prepared RAM file checked first, x-ignore-shared set) and continues
// the VM. On failure it quits QEMU: a QEMU left waiting forever would look
// like a running VM.
func newLoadCmd() *cobra.Command {
	var (
		dir, qmpPath string
		timeout      time.Duration
		stream       streamFlags
	)
	c := &cobra.Command{
		Use:    "load --dir DIR --qmp SOCK",
		Short:  "Load a staged memory-file snapshot into a QEMU waiting with -incoming defer (started by vmsnap launch)",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if dir == "" || qmpPath == "" {
				return coded(errcode.New(errcode.Usage, "load needs --dir DIR and --qmp SOCK"))
			}
			ctx, cancel := context.WithTimeout(c.Context(), timeout)
			defer cancel()
			err := runLoad(ctx, c.ErrOrStderr(), dir, qmpPath, stream)
			if err != nil {
				fmt.Fprintf(c.ErrOrStderr(), "vmsnap load: %v: quitting QEMU\n", err)
				qctx, qcancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer qcancel()
				if mon, derr := qmp.Dial(qctx, qmpPath); derr == nil {
					_ = mon.Execute(qctx, "quit", nil, nil)
					mon.Close()
				}
			}
			return coded(err)
		},
	}
	c.Flags().StringVar(&dir, "dir", "", "where restore --to-dir staged the snapshot and prepare --state-dir recorded its RAM file")
	c.Flags().StringVar(&qmpPath, "qmp", "", "the waiting QEMU's monitor socket")
	c.Flags().DurationVar(&timeout, "timeout", 10*time.Minute, "give up (and quit QEMU) after this long")
	stream.add(c, streamWorkers)
	return c
}

func runLoad(ctx context.Context, log io.Writer, dir, qmpPath string, f streamFlags) error {
	prepared, err := snapshot.PreparedArgs(ctx, dir)
	if err != nil {
		return err
	}
	d := prepared.Digest
	// QEMU is starting: wait for its monitor, then leave it to the restore.
	mon, err := dialRetry(ctx, qmpPath)
	if err != nil {
		return errcode.Ensure(errcode.QMPError, err, "waiting for QEMU's monitor at %s", qmpPath)
	}
	mon.Close()
	abs, err := filepath.Abs(dir)
	if err != nil {
		return errcode.Wrap(errcode.Usage, err, "%s", dir)
	}
	// The RAM cache is the pod's own volume, where prepare put the file
	// QEMU must map private.
	res, err := snapshot.RestoreState(ctx, snapshot.RestoreSpec{QMPPath: qmpPath, Image: "oci:" + abs + "@" + d.String(), Stream: f.options(),
		CacheDir: filepath.Dir(prepared.MemoryFile), PrivateParent: true})
	if err != nil {
		return err
	}
	fmt.Fprintf(log, "vmsnap load: loaded %s into QEMU in %.0f ms; the VM runs\n", d, res.VMState.DurationsMs["total"])
	return nil
}
