package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/internal/atomicfile"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

// execQEMU replaces this process with QEMU. Tests replace it to see the
// command line instead.
var execQEMU = syscall.Exec

// What a launcher does when its pod has loaded the snapshot already.
const (
	onRestartCold = "cold"
	onRestartFail = "fail"
)

type launchFlags struct {
	stateDir, qmp, markerDir, onRestart string
	deferred                            bool
}

func newLaunchCmd(out *globalOutput) *cobra.Command {
	var f launchFlags
	c := &cobra.Command{
		Use:   "launch --marker-dir DIR (--state-dir DIR --qmp SOCK | --defer) [--on-restart cold|fail] -- QEMU [ARGS...]",
		Short: "Start a restored pod's QEMU so that its snapshot is loaded at most once",
		Long: `Start QEMU (by exec: QEMU takes this process's place) for a pod restored from a
snapshot, loading the snapshot's memory at most once in the pod's life.

The first start claims the snapshot with a marker file in --marker-dir,
written and synced before QEMU starts, then runs QEMU with
  -incoming "exec:vmsnap stream --dir STATE_DIR --qmp SOCK"   (--state-dir)
  -incoming defer                                             (--defer)
appended to ARGS. The marker is named after the staged state's digest
(loaded-sha256-HEX; loaded-defer with --defer).

When the marker is there already, the container has been started before in
this pod (QEMU crashed, was killed, the guest powered off, the pod's sandbox
was recreated). Loading the snapshot's memory again would put it on top of a
disk the guest has written since and corrupt the guest's file systems, so:
  --on-restart cold  (default) QEMU starts without -incoming: the guest boots
                     from its disk as it is now, as after a crash;
  --on-restart fail  the command fails, saying so, and QEMU does not start.
The marker is claimed before the load: a crash during the load means a cold
boot next time, never a second load.

--marker-dir must be writable and live as long as the pod: an emptyDir on
disk (not medium: Memory, which a node reboot empties), the one the restore
init container writes its own marker to.

ARGS are the source VM's exact options, without -incoming (refused: the
launcher adds it). -qmp unix:SOCK,server=on,wait=off must be among them for
--state-dir: vmsnap stream continues the VM over that monitor once loaded.

A memory-file snapshot (its RAM a file, restore --to-dir staged only its
device state) needs its RAM file prepared first: vmsnap prepare REF@sha256:...
--cache-dir RAM_DIR --state-dir STATE_DIR records the QEMU arguments that map
it in STATE_DIR/prepared.json, which launch checks against the staged
snapshot. The first start then adds those arguments and -incoming defer, and
a detached "vmsnap load --dir STATE_DIR --qmp SOCK" waits for QEMU's monitor,
checks QEMU against the recorded VM, loads the device state (with
x-ignore-shared, which QEMU 7.2 cannot take on its command line) and
continues the VM; if the load fails it quits QEMU, so the container restarts
and --on-restart decides.`,
		Args: cobra.ArbitraryArgs,
		RunE: func(c *cobra.Command, args []string) error {
			if c.ArgsLenAtDash() != 0 {
				return errcode.New(errcode.Usage, "put QEMU's command line after --: vmsnap launch [flags] -- qemu-system-x86_64 ARGS...")
			}
			return coded(runLaunch(c.Context(), out, f, args))
		},
	}
	c.Flags().StringVar(&f.stateDir, "state-dir", "", "where the restore init container staged the VM state (restore --to-dir)")
	c.Flags().StringVar(&f.qmp, "qmp", "", "with --state-dir: QEMU's monitor socket, for vmsnap stream to continue the VM once loaded")
	c.Flags().BoolVar(&f.deferred, "defer", false, "start QEMU with -incoming defer, for the agent to load the state (vmsnap restore --agent)")
	c.Flags().StringVar(&f.markerDir, "marker-dir", "", "a writable directory living as long as the pod (an emptyDir) for the marker (required)")
	c.Flags().StringVar(&f.onRestart, "on-restart", onRestartCold, "when the snapshot was loaded in this pod before: cold (boot from the disk as it is) or fail")
	return c
}

// shellSafe are the characters launch puts unquoted into QEMU's exec:
// command line, which QEMU runs through /bin/sh.
var shellSafe = regexp.MustCompile(`^[A-Za-z0-9_./+:@=-]+$`)

func runLaunch(ctx context.Context, out *globalOutput, f launchFlags, argv []string) error {
	if err := f.check(argv); err != nil {
		return err
	}
	qemu, err := exec.LookPath(argv[0])
	if err != nil {
		return errcode.Wrap(errcode.Usage, err, "finding QEMU %q", argv[0])
	}
	name, what, incoming, loader, err := f.plan(ctx)
	if err != nil {
		return err
	}
	marker := filepath.Join(f.markerDir, name)
	claimed, err := claimMarker(marker, fmt.Sprintf("%s loaded by pid %d at %s\n", what, os.Getpid(), time.Now().UTC().Format(time.RFC3339)))
	if err != nil {
		return err
	}
	switch {
	case claimed:
		fmt.Fprintf(out.stderr, "vmsnap launch: loading %s, once (marker %s claimed): %s\n", what, marker, strings.Join(incoming, " "))
		argv = append(argv, incoming...)
		if loader != nil {
			// Before QEMU: this process becomes QEMU. The loader waits
			// for its monitor.
			if err := startLoader(loader); err != nil {
				return errcode.Wrap(errcode.Internal, err, "starting the vmsnap that loads the state into QEMU")
			}
		}
	case f.onRestart == onRestartFail:
		return errcode.New(errcode.InvalidInput,
			"%s was loaded in this pod before (marker %s): this QEMU container has restarted since, and loading it again would put old memory on a disk the guest has written since. "+
				"--on-restart fail keeps QEMU stopped: delete the pod (a new pod restores afresh), or use --on-restart cold to boot from the disk as it is now", what, marker)
	default:
		fmt.Fprintf(out.stderr, "vmsnap launch: %s was loaded in this pod before (marker %s): starting QEMU cold, from the disk as it is now, without -incoming\n", what, marker)
	}
	if err := execQEMU(qemu, argv, os.Environ()); err != nil {
		return errcode.Wrap(errcode.Internal, err, "starting %s", qemu)
	}
	return nil
}

func (f launchFlags) check(argv []string) error {
	switch {
	case f.markerDir == "":
		return errcode.New(errcode.Usage, "launch needs --marker-dir DIR: a writable emptyDir of the pod, where the marker that the snapshot was loaded goes")
	case f.onRestart != onRestartCold && f.onRestart != onRestartFail:
		return errcode.New(errcode.Usage, "--on-restart %q: use cold or fail", f.onRestart)
	case f.deferred == (f.stateDir != ""):
		return errcode.New(errcode.Usage, "launch needs one of --state-dir DIR (QEMU loads the staged state itself) or --defer (the agent loads it)")
	case f.stateDir != "" && f.qmp == "":
		return errcode.New(errcode.Usage, "--state-dir needs --qmp SOCK, QEMU's monitor: without it a VM checkpointed in pause mode would stay stopped once loaded")
	case f.deferred && f.qmp != "":
		return errcode.New(errcode.Usage, "--qmp goes with --state-dir; with --defer the agent is given the monitor")
	case len(argv) == 0:
		return errcode.New(errcode.Usage, "no QEMU command line: put it after --")
	}
	for _, a := range argv[1:] {
		if a == "-incoming" || a == "--incoming" || strings.HasPrefix(a, "-incoming=") || strings.HasPrefix(a, "--incoming=") {
			return errcode.New(errcode.Usage, "QEMU's command line has %s: launch adds -incoming itself on the first start only; remove it", a)
		}
	}
	if f.stateDir != "" && !slices.ContainsFunc(argv[1:], func(a string) bool { return strings.Contains(a, "unix:"+f.qmp) || strings.Contains(a, "path="+f.qmp) }) {
		return errcode.New(errcode.Usage, "QEMU's options have no monitor at %s: add -qmp unix:%s,server=on,wait=off, or vmsnap stream could not continue the VM once loaded", f.qmp, f.qmp)
	}
	if f.stateDir != "" {
		for _, p := range []string{f.stateDir, f.qmp} {
			if !filepath.IsAbs(p) || !shellSafe.MatchString(p) {
				return errcode.New(errcode.Usage, "%q: give an absolute path of letters, digits and _./+:@=- only (it goes into QEMU's exec: command line, run by /bin/sh)", p)
			}
		}
	}
	return nil
}

// startLoader starts, detached (a session of its own, so that it outlives
// this process becoming QEMU), the vmsnap command that loads a memory-file
// snapshot's device state into QEMU over its monitor. Tests replace it.
var startLoader = func(argv []string) error {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout = os.Stderr // the container's log, as QEMU's
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	return cmd.Process.Release()
}

// plan returns the marker's name, what is loaded (for messages), the
// -incoming arguments of a first start and, for a memory-file snapshot,
// the command line of the vmsnap that loads it (nil otherwise).
//
// A memory-file snapshot needs QEMU's x-ignore-shared capability on the
// target before the load begins, and QEMU 7.2 cannot take it on its
// command line (no migration.x-ignore-shared property before 8.x; checked:
// "Property 'migration.x-ignore-shared' not found"): an -incoming exec:
// migration starts at QEMU's start, before any monitor command. So QEMU
// starts with the prepared RAM file's arguments and -incoming defer, and
// `vmsnap load` sets the capability, checks the QEMU against the recorded
// VM (the RAM file mapped private is the one prepared for this snapshot)
// and loads the device state, as vmsnap restore --qmp does.
func (f launchFlags) plan(ctx context.Context) (name, what string, incoming, loader []string, err error) {
	if f.deferred {
		return "loaded-defer", "the VM state (loaded by the agent into -incoming defer)", []string{"-incoming", "defer"}, nil, nil
	}
	d, cfg, err := snapshot.StagedConfig(ctx, f.stateDir)
	if err != nil {
		return "", "", nil, nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return "", "", nil, nil, errcode.Wrap(errcode.Internal, err, "finding the vmsnap binary for QEMU's exec: command")
	}
	if cfg.Format == vmspec.FormatMemoryFile {
		prepared, err := snapshot.PreparedArgs(ctx, f.stateDir)
		if err != nil {
			return "", "", nil, nil, err
		}
		incoming = append(append([]string(nil), prepared.QEMUArgs...), "-incoming", "defer")
		return markerName("loaded", d), "the memory-file snapshot " + d.String() + " staged in " + f.stateDir + " (its RAM file prepared)",
			incoming, []string{self, "load", "--dir", f.stateDir, "--qmp", f.qmp}, nil
	}
	if !shellSafe.MatchString(self) {
		return "", "", nil, nil, errcode.New(errcode.Usage, "the vmsnap binary's path %q has characters /bin/sh would interpret: install it elsewhere", self)
	}
	return markerName("loaded", d), "the snapshot " + d.String() + " staged in " + f.stateDir,
		[]string{"-incoming", "exec:" + self + " stream --dir " + f.stateDir + " --qmp " + f.qmp}, nil, nil
}

// markerName is PREFIX-ALGO-HEX: a file name for a digest.
func markerName(prefix string, d digest.Digest) string {
	return prefix + "-" + d.Algorithm().String() + "-" + d.Encoded()
}

// claimMarker creates the marker file, and reports false if it existed.
// The file and its directory entry are on disk before it returns true: a
// crash right after the claim leaves the snapshot claimed.
func claimMarker(p, content string) (bool, error) {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if errors.Is(err, os.ErrExist) {
		return false, nil
	}
	if err != nil {
		return false, errcode.Wrap(errcode.Internal, err, "claiming the snapshot: creating the marker (is --marker-dir a writable volume?)")
	}
	_, werr := f.WriteString(content)
	if werr == nil {
		werr = f.Sync()
	}
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr == nil {
		werr = atomicfile.SyncDir(filepath.Dir(p))
	}
	if werr != nil {
		// Keep the marker: claimed is the safe side, a cold boot.
		return false, errcode.Wrap(errcode.Internal, werr, "claiming the snapshot: writing the marker %s; it stays, so the next start boots cold", p)
	}
	return true, nil
}
