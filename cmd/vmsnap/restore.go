package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/qmp"
	"github.com/vmsnap/vmsnap/rootfs"
	"github.com/vmsnap/vmsnap/vmstate"
)

type restoreFlags struct {
	qmp, image, disk, diskImage string
	paused, allowTag            bool
	timeout                     time.Duration
	stream                      streamFlags
}

func newRestoreCmd(out *globalOutput) *cobra.Command {
	var f restoreFlags
	c := &cobra.Command{
		Use:   "restore (--disk-image REF@DIGEST --disk PATH | --qmp SOCK --image REF@DIGEST [--paused])",
		Short: "Put a disk overlay in place, or load VM state into a waiting QEMU",
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

Images are taken by digest only (as printed by checkpoint), unless --allow-tag.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			return coded(runRestore(c.Context(), out, f))
		},
	}
	c.Flags().StringVar(&f.qmp, "qmp", "", "monitor socket of a QEMU started with -incoming defer")
	c.Flags().StringVar(&f.image, "image", "", "the VM state image, REF@sha256:... (with --qmp)")
	c.Flags().StringVar(&f.diskImage, "disk-image", "", "the disk overlay image, REF@sha256:... (with --disk)")
	c.Flags().StringVar(&f.disk, "disk", "", "where to put the restored qcow2 overlay (with --disk-image)")
	c.Flags().BoolVar(&f.paused, "paused", false, "leave the VM stopped once loaded (start QEMU with -S so it never runs)")
	c.Flags().BoolVar(&f.allowTag, "allow-tag", false, "accept a tag instead of a digest (the image may change under you)")
	c.Flags().DurationVar(&f.timeout, "timeout", 30*time.Minute, "give up after this long")
	f.stream.add(c)
	addOutputFlags(c, out, true)
	return c
}

type restoreDoc struct {
	VMState *restoreStateDoc `json:"vmstate,omitempty"`
	Disk    *restoreDiskDoc  `json:"disk,omitempty"`
}

type restoreStateDoc struct {
	Image       string             `json:"image"`
	Digest      string             `json:"digest"`
	RawBytes    int64              `json:"rawBytes"`
	VMRunning   bool               `json:"vmRunning"`
	DurationsMs map[string]float64 `json:"durationsMs"`
}

type restoreDiskDoc struct {
	Image       string             `json:"image"`
	Digest      string             `json:"digest"`
	Path        string             `json:"path"`
	Bytes       int64              `json:"bytes"`
	DurationsMs map[string]float64 `json:"durationsMs"`
}

// openPinned parses a reference for restore: digests only, unless allowed.
func openPinned(ctx context.Context, s, flag string, allowTag bool) (ociimage.Repository, error) {
	ref, err := ociimage.ParseReference(s)
	if err != nil {
		return nil, err
	}
	if !ref.IsDigest() && !allowTag {
		return nil, errcode.New(errcode.TagNotAllowed,
			"%s %s names a tag, which can move: give the digest that checkpoint printed (REF@sha256:...), or pass --allow-tag", flag, s)
	}
	return ociimage.Open(ctx, ref)
}

func runRestore(ctx context.Context, out *globalOutput, f restoreFlags) error {
	stateForm := f.qmp != "" || f.image != ""
	diskForm := f.disk != "" || f.diskImage != ""
	switch {
	case stateForm && diskForm:
		return errcode.New(errcode.Usage, "restore the disk (--disk-image, --disk) before QEMU starts, and the state (--qmp, --image) into the QEMU started afterwards: these are two commands")
	case stateForm && (f.qmp == "" || f.image == ""):
		return errcode.New(errcode.Usage, "restoring VM state needs both --qmp SOCK and --image REF@DIGEST")
	case diskForm && (f.disk == "" || f.diskImage == ""):
		return errcode.New(errcode.Usage, "restoring a disk overlay needs both --disk-image REF@DIGEST and --disk PATH")
	case !stateForm && !diskForm:
		return errcode.New(errcode.Usage, "nothing to restore: give --disk-image and --disk, or --qmp and --image (see vmsnap restore --help)")
	}
	ctx, cancel := context.WithTimeout(ctx, f.timeout)
	defer cancel()

	if diskForm {
		repo, err := openPinned(ctx, f.diskImage, "--disk-image", f.allowTag)
		if err != nil {
			return err
		}
		p := newProgress(out.stderr, "disk")
		res, err := rootfs.Restore(ctx, repo, f.disk, f.stream.options(p))
		p.finish()
		if err != nil {
			return err
		}
		doc := restoreDoc{Disk: &restoreDiskDoc{
			Image: repo.Reference().WithDigest(res.Manifest.Digest).String(), Digest: res.Manifest.Digest.String(),
			Path: f.disk, Bytes: res.Bytes, DurationsMs: map[string]float64{"total": ms(res.Duration)},
		}}
		report(out, doc, func(w io.Writer) {
			fmt.Fprintf(w, "disk overlay restored to %s (%s, verified) in %.2fs\n", f.disk, humanBytes(res.Bytes), res.Duration.Seconds())
		})
		return nil
	}

	repo, err := openPinned(ctx, f.image, "--image", f.allowTag)
	if err != nil {
		return err
	}
	mon, err := qmp.Dial(ctx, f.qmp)
	if err != nil {
		return err
	}
	defer mon.Close()
	p := newProgress(out.stderr, "restore")
	res, err := vmstate.Restore(ctx, mon, repo, vmstate.RestoreOptions{Paused: f.paused, Stream: f.stream.options(p)})
	p.finish()
	if err != nil {
		return err
	}
	doc := restoreDoc{VMState: &restoreStateDoc{
		Image: repo.Reference().WithDigest(res.Manifest.Digest).String(), Digest: res.Manifest.Digest.String(),
		RawBytes: res.RawBytes, VMRunning: res.VMRunning,
		DurationsMs: map[string]float64{"prepare": ms(res.Durations.Prepare), "stream": ms(res.Durations.Stream), "total": ms(res.Durations.Total)},
	}}
	report(out, doc, func(w io.Writer) {
		state := "running"
		if !res.VMRunning {
			state = "paused"
		}
		fmt.Fprintf(w, "VM state restored (%s, verified) in %.2fs; the VM is %s\n", humanBytes(res.RawBytes), res.Durations.Total.Seconds(), state)
	})
	return nil
}
