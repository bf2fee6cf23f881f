package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
)

type restoreFlags struct {
	qmp, image, disk, diskImage, toDir string
	stagingDir, markerDir, cacheDir    string
	paused, allowTag                   bool
	maxBytes                           int64
	timeout                            time.Duration
	stream                             streamFlags
	registry                           registryFlags
	decrypt                            decryptFlags
	verify                             verifyFlags
	agent                              agentFlags
}

func newRestoreCmd(out *globalOutput) *cobra.Command {
	var f restoreFlags
	c := &cobra.Command{
		Use:   "restore (--disk-image REF@DIGEST --disk PATH | --qmp SOCK --image REF@DIGEST [--paused] | --image REF@DIGEST --to-dir DIR)",
		Short: "Put a disk overlay in place, load VM state into a waiting QEMU, or stage a snapshot",
		Long: `Restore a checkpoint in two steps, because QEMU opens its disk when it starts:

  1. Before QEMU starts, put the disk overlay in place:
       vmsnap restore --disk-image REF@sha256:... --disk PATH
     The overlay is verified chunk by chunk and appears at PATH only once
     complete; its backing file must already exist beside it.

  2. Start QEMU with the same machine options as the source plus
     -incoming defer, then load the VM state into it:
       vmsnap restore --qmp SOCK --image REF@sha256:... [--paused]
     The waiting QEMU is compared with the recorded VM first (version, machine
     type, CPUs, memory, devices, disks): on any difference nothing is sent and
     the command fails with COMPAT_MISMATCH, listing each one. Every chunk is
     verified against its digest before QEMU sees a byte of it.
     A snapshot in QEMU's mapped-ram format (see checkpoint --format) needs
     a QEMU 9.0 or later: its chunks are all verified into a sparse file in
     --staging-dir first, and QEMU then loads that file.

In a Kubernetes pod, a restore init container does step 1 and stages the
state in the pod's volume, verified, within --max-bytes:
       vmsnap restore --image REF@sha256:... --to-dir /vm/state \
           [--disk-image REF@sha256:... --disk /vm/disk/overlay.qcow2]
and the QEMU container then starts with
       vmsnap launch --state-dir /vm/state --qmp /vm/run/qmp.sock \
           --marker-dir /vm/markers -- qemu-system-x86_64 ...
which adds -incoming "exec:vmsnap stream --dir /vm/state --qmp /vm/run/qmp.sock"
on its first start only (see vmsnap launch --help).
With --marker-dir (a writable emptyDir of the pod), a re-run of the init
container (the pod's sandbox was recreated, after a node reboot for example)
finds the marker of its earlier successful run and leaves the overlay and the
staged state as they are: the guest has written to that overlay since.
Alternatively QEMU starts with -incoming defer and the node agent loads the
state (which checks compatibility first):
       vmsnap restore --agent unix:///run/vmsnap/agent.sock --pod-uid UID \
           --container qemu --qmp /run/vm/qmp.sock --image REF@sha256:...
Its result carries the VM's new endpoint (pod UID, container, QMP path).

Images are taken by digest only (as printed by checkpoint), unless --allow-tag.
Each of --image and --disk-image may name the image itself (vmstate.image,
disk.image) or the whole checkpoint (checkpoint.image, the digest of its
index): restore then takes the part it needs from the checkpoint, a disk image
in another repository from the registry the checkpoint is read from.
From a registry, several chunks are fetched at once and each is verified
before its bytes are used; registry credentials and TLS work as for
checkpoint (--registry-config, --ca-file, --insecure-registry).

With --verify-key, each image given (--image, --disk-image) must carry a
cosign signature by one of the keys, for its digest and its repository
path, at the tag sha256-HEX.sig of its repository (vmsnap checkpoint
--sign-key or cosign sign --key made it); it is checked before any other
byte of the image is read, and an unsigned or wrongly signed image fails
with AUTH_FAILED. A memory-file image restored from the RAM file prepared
on this node has its signature read from its repository all the same.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			return coded(runRestore(c.Context(), out, f))
		},
	}
	c.Flags().StringVar(&f.qmp, "qmp", "", "monitor socket of a QEMU started with -incoming defer")
	c.Flags().StringVar(&f.image, "image", "", "the VM state image or its checkpoint, REF@sha256:... (with --qmp or --to-dir)")
	c.Flags().StringVar(&f.diskImage, "disk-image", "", "the disk overlay image or its checkpoint, REF@sha256:... (with --disk)")
	c.Flags().StringVar(&f.disk, "disk", "", "where to put the restored qcow2 overlay (with --disk-image)")
	c.Flags().StringVar(&f.toDir, "to-dir", "", "stage the VM state image, verified, in this directory for `vmsnap stream --dir`")
	c.Flags().Int64Var(&f.maxBytes, "max-bytes", 0, "with --to-dir: refuse an image larger than this many bytes (0: no limit)")
	c.Flags().BoolVar(&f.paused, "paused", false, "leave the VM stopped once loaded (start QEMU with -S so it never runs)")
	c.Flags().StringVar(&f.stagingDir, "staging-dir", "", "with --qmp: where a mapped-ram snapshot is staged, verified, for QEMU to load (default $TMPDIR)")
	c.Flags().StringVar(&f.cacheDir, "cache-dir", snapshot.DefaultCacheDir(), "with --qmp: the RAM cache vmsnap prepare filled; a memory-file snapshot prepared there from the same repository is read from it, not from the store")
	c.Flags().StringVar(&f.markerDir, "marker-dir", "", "restore once per pod: skip (and say so) when this directory holds the marker of an earlier successful run of the same restore; write it on success")
	c.Flags().BoolVar(&f.allowTag, "allow-tag", false, "accept a tag instead of a digest (the image may change under you)")
	c.Flags().DurationVar(&f.timeout, "timeout", 30*time.Minute, "give up after this long")
	f.stream.add(c, fmt.Sprintf("%s; with --to-dir, %d blobs fetched at once", streamWorkers, snapshot.DefaultStageWorkers))
	addFlagGroups(c, &f.registry, &f.decrypt, &f.verify, &f.agent)
	addOutputFlags(c, out, true)
	return c
}

func runRestore(ctx context.Context, out *globalOutput, f restoreFlags) error {
	if err := f.agent.check(); err != nil {
		return err
	}
	if err := f.check(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, f.timeout)
	defer cancel()
	if f.agent.address != "" {
		return restoreViaAgent(ctx, out, f)
	}
	return restoreHere(ctx, out, f)
}

// diskForm reports whether the command restores a disk overlay.
func (f *restoreFlags) diskForm() bool {
	return f.disk != "" || f.diskImage != ""
}

// check refuses the flag combinations that name no single restore.
func (f *restoreFlags) check() error {
	diskForm := f.diskForm()
	switch {
	case diskForm && (f.disk == "" || f.diskImage == ""):
		return errcode.New(errcode.Usage, "restoring a disk overlay needs both --disk-image REF@DIGEST and --disk PATH")
	case f.qmp != "" && f.toDir != "":
		return errcode.New(errcode.Usage, "--qmp loads the state into a waiting QEMU, --to-dir stages it for one that starts later: choose one")
	case f.qmp != "" && diskForm:
		return errcode.New(errcode.Usage, "restore the disk (--disk-image, --disk) before QEMU starts, and the state (--qmp, --image) into the QEMU started afterwards: these are two commands")
	case f.qmp != "" && f.image == "":
		return errcode.New(errcode.Usage, "restoring VM state needs both --qmp SOCK and --image REF@DIGEST")
	case f.toDir != "" && f.image == "":
		return errcode.New(errcode.Usage, "--to-dir stages a VM state image: give --image REF@DIGEST")
	case f.image != "" && f.qmp == "" && f.toDir == "":
		return errcode.New(errcode.Usage, "--image needs a destination: --qmp SOCK (a waiting QEMU) or --to-dir DIR")
	case f.qmp == "" && f.toDir == "" && !diskForm:
		return errcode.New(errcode.Usage, "nothing to restore: give --disk-image and --disk, or --qmp and --image, or --image and --to-dir (see vmsnap restore --help)")
	case f.agent.address != "" && len(f.decrypt.keys) > 0:
		return errcode.New(errcode.Usage, "through --agent, the agent decrypts with the keys of its own --decryption-key-dir (a mounted Secret): drop --decryption-key")
	case f.agent.address != "" && len(f.verify.keys) > 0:
		return errcode.New(errcode.Usage, "through --agent, the agent verifies signatures with its own keys (--verify-key, --require-signature: the operator's policy): drop --verify-key")
	case f.agent.address != "" && (f.qmp == "" || diskForm || f.toDir != ""):
		return errcode.New(errcode.Usage, "through --agent, restore loads VM state into a waiting QEMU: give --qmp (the path in the container) and --image only")
	case f.markerDir != "" && (f.qmp != "" || f.agent.address != ""):
		return errcode.New(errcode.Usage, "--marker-dir goes with a restore before QEMU starts (--disk-image, --to-dir); vmsnap launch marks the load")
	case f.markerDir != "" && f.allowTag:
		return errcode.New(errcode.Usage, "--marker-dir keys its marker by the images' digests: give REF@sha256:... references, without --allow-tag")
	case f.cacheDir != snapshot.DefaultCacheDir() && (f.qmp == "" || f.agent.address != ""):
		return errcode.New(errcode.Usage, "--cache-dir is where a local restore into a waiting QEMU (--qmp) finds what vmsnap prepare made; through --agent, the agent uses its cache of the VM's namespace")
	case f.stagingDir != "" && (f.qmp == "" || f.agent.address != ""):
		return errcode.New(errcode.Usage, "--staging-dir is where a local restore into a waiting QEMU (--qmp) stages a mapped-ram snapshot")
	}
	return nil
}

func restoreViaAgent(ctx context.Context, out *globalOutput, f restoreFlags) error {
	o, err := viaAgent(ctx, out, f.agent.address, func(c *agent.Client) (api.Operation, error) {
		return c.Restore(ctx, api.RestoreRequest{
			VM: f.agent.vm(f.qmp, ""), Image: f.image, AllowTag: f.allowTag, Paused: f.paused, Workers: f.stream.workers,
		})
	})
	if err != nil {
		return err
	}
	report(out, o.Restore, func(w io.Writer) { printRestore(w, o.Restore) })
	return nil
}

func restoreHere(ctx context.Context, out *globalOutput, f restoreFlags) error {
	mark, done, err := restoredBefore(out, f)
	if err != nil || done {
		return err
	}
	res := &api.RestoreResult{}
	p := newPhasedProgress(out.stderr)
	defer p.finish()
	decrypt, err := f.decrypt.options()
	if err != nil {
		return err
	}
	verify, err := f.verify.options()
	if err != nil {
		return err
	}
	store := append(append(f.registry.options(), decrypt...), verify...)
	if f.diskForm() {
		d, err := snapshot.RestoreDisk(ctx, snapshot.DiskRestoreSpec{
			Image: f.diskImage, Path: f.disk, AllowTag: f.allowTag, Stream: f.stream.options(), Store: store, Progress: p.update,
		})
		if err != nil {
			return err
		}
		res.Disk = d
	}
	if f.toDir != "" {
		st, err := snapshot.Stage(ctx, snapshot.StageSpec{
			Image: f.image, Dir: f.toDir, AllowTag: f.allowTag, MaxBytes: f.maxBytes, Workers: f.stream.workers, Store: store,
		})
		if err != nil {
			return err
		}
		res.Staged = st
	}
	if f.qmp != "" {
		r, err := snapshot.RestoreState(ctx, snapshot.RestoreSpec{
			QMPPath: f.qmp, Image: f.image, AllowTag: f.allowTag, Paused: f.paused,
			Stream: f.stream.options(), Store: store, Progress: p.update, StagingDir: f.stagingDir, CacheDir: f.cacheDir,
		})
		if err != nil {
			return err
		}
		res.VMState = r.VMState
	}
	p.finish()
	if mark != nil {
		if err := mark.write(res); err != nil {
			return err
		}
	}
	report(out, res, func(w io.Writer) { printRestore(w, res) })
	return nil
}

func printRestore(w io.Writer, r *api.RestoreResult) {
	if d := r.Disk; d != nil {
		fmt.Fprintf(w, "disk overlay restored to %s (%s, verified) in %.2fs\n", d.Path, humanBytes(d.Bytes), d.DurationsMs["total"]/1000)
	}
	if s := r.Staged; s != nil {
		fmt.Fprintf(w, "VM state staged in %s (%s, verified): start QEMU with vmsnap launch --state-dir %s --qmp SOCK --marker-dir DIR -- QEMU ARGS...\n", s.Dir, humanBytes(s.Bytes), s.Dir)
	}
	if r.AlreadyRestored != "" {
		fmt.Fprintf(w, "already restored in this pod (marker %s): nothing replaced\n", r.AlreadyRestored)
	}
	if s := r.VMState; s != nil {
		state := "running"
		if !s.VMRunning {
			state = "paused"
		}
		fmt.Fprintf(w, "VM state restored (%s, verified) in %.2fs; the VM is %s\n", humanBytes(s.RawBytes), s.DurationsMs["total"]/1000, state)
		if s.GenerationID != "" {
			fmt.Fprintf(w, "the guest finds a new VM generation ID, %s (its RNG reseeds)\n", s.GenerationID)
		}
	}
	if e := r.Endpoint; e != nil {
		fmt.Fprintf(w, "the VM now lives in pod %s, container %s, monitor %s\n", e.PodUID, e.Container, e.QMPPath)
	}
}
