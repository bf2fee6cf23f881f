package main

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/vmstate"
)

func newInspectCmd(out *globalOutput) *cobra.Command {
	var reg registryFlags
	var timeout time.Duration
	c := &cobra.Command{
		Use:   "inspect REF",
		Short: "Show what a snapshot image holds, and the images of its checkpoint",
		Long: `Show a checkpoint, or a VM state or disk overlay image: its digest, the
recorded VM (QEMU version, machine, CPUs, memory, devices, disks), sizes and
chunks.

REF may name a checkpoint (the tag checkpoint moved, or its checkpoint
digest): then its VM state image is shown, and the images of the checkpoint
are listed together, pinned by digest: the VM state, the disk overlay (an
image of its own, or "in the rootfs image" at its path when it lived in the
QEMU container's writable layer) and the rootfs image (the container's image
plus its writable layer), followed by the disk image's details. For a disk
image of a checkpoint from before checkpoint indexes, the VM state images
that refer to it (their manifest's subject) in the same repository.

Nothing is restored; every byte read is verified against its digest. Registry
access works as for checkpoint (--registry-config, --ca-file,
--insecure-registry).`,
		Args: cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			ctx, cancel := context.WithTimeout(c.Context(), timeout)
			defer cancel()
			return coded(runInspect(ctx, out, args[0], reg.options()))
		},
	}
	reg.add(c)
	c.Flags().DurationVar(&timeout, "timeout", 10*time.Minute, "give up after this long")
	addOutputFlags(c, out, false)
	return c
}

func runInspect(ctx context.Context, out *globalOutput, s string, opts []ociimage.Option) error {
	doc, err := snapshot.Inspect(ctx, snapshot.InspectSpec{Image: s, Store: opts})
	if err != nil {
		return err
	}
	report(out, doc, func(w io.Writer) { printInspect(w, doc, "") })
	return nil
}

func printInspect(w io.Writer, d *snapshot.InspectResult, indent string) {
	if c := d.Checkpoint; c != nil {
		if c.Image != "" {
			fmt.Fprintf(w, "%scheckpoint: %s\n", indent, c.Image)
		}
		fmt.Fprintf(w, "%scheckpoint images:\n", indent)
		fmt.Fprintf(w, "%s  vmstate: %s\n", indent, c.VMState)
		if c.Disk != "" {
			fmt.Fprintf(w, "%s  disk:    %s\n", indent, c.Disk)
		}
		if r := c.DiskInRootfs; r != nil {
			what := "disk:    in"
			if c.Disk != "" {
				what = "         also in"
			}
			fmt.Fprintf(w, "%s  %s the rootfs image, at %s\n", indent, what, r.Path)
		}
		if r := d.LinkedRootfs; r != nil {
			base := ""
			if r.BaseImage != "" {
				base = " on " + r.BaseImage
			}
			fmt.Fprintf(w, "%s  rootfs:  %s\n%s           container image%s: %d layers, %s, its writable layer %s\n",
				indent, r.Image, indent, base, r.Layers, humanBytes(r.Bytes), humanBytes(r.LayerBytes))
		}
	}
	fmt.Fprintf(w, "%simage:   %s\n", indent, d.Image)
	fmt.Fprintf(w, "%schunks:  %d, %s stored\n", indent, d.Chunks, humanBytes(d.StoredBytes))
	if len(d.EncryptedFor) > 0 {
		fmt.Fprintf(w, "%sencrypted for: %s (restore needs --decryption-key with one of their private keys)\n", indent, strings.Join(d.EncryptedFor, ", "))
	}
	if len(d.Layers) > 1 {
		for _, k := range d.Layers {
			fmt.Fprintf(w, "%s  %-12s %5d layers, %s (largest %s)\n", indent, k.Kind+":", k.Count, humanBytes(k.Bytes), humanBytes(k.Largest))
		}
	}
	if c := d.VMState; c != nil {
		printVMStateConfig(w, c, indent)
	}
	if c := d.Disk; c != nil {
		fmt.Fprintf(w, "%skind:    disk overlay (qcow2 v%d, %s virtual, taken %s)\n", indent, c.Version, humanBytes(int64(c.VirtualSize)), c.Created.Format("2006-01-02 15:04:05Z"))
		if c.BackingFile != "" {
			fmt.Fprintf(w, "%sbacking: %s (%s), relative to the overlay\n", indent, c.BackingFile, c.BackingFormat)
		}
	}
	keys := make([]string, 0, len(d.Annotations))
	for k := range d.Annotations {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(w, "%s  %s=%s\n", indent, k, d.Annotations[k])
	}
	if d.LinkedDisk != nil {
		fmt.Fprintf(w, "%slinked disk image:\n", indent)
		printInspect(w, d.LinkedDisk, indent+"  ")
	}
	if len(d.Referrers) > 0 {
		fmt.Fprintf(w, "%sVM state images of this disk:\n", indent)
		for _, r := range d.Referrers {
			fmt.Fprintf(w, "%s  %s (mode %s, taken %s)\n", indent, r.Image, r.Annotations[ociimage.AnnotationMode], r.Annotations[ociimage.AnnotationCreated])
		}
	}
}

// printVMStateConfig is printInspect's part for a VM state image: its
// format, RAM file and compatibility record.
func printVMStateConfig(w io.Writer, c *vmstate.Config, indent string) {
	r := c.Record
	fmt.Fprintf(w, "%skind:    VM state (mode %s, taken %s)\n", indent, c.Mode, c.Created.Format("2006-01-02 15:04:05Z"))
	format := string(c.Format)
	if format == "" {
		format = "stream"
	}
	fmt.Fprintf(w, "%sformat:  %s\n", indent, format)
	fmt.Fprintf(w, "%sstream:  %s raw, %s\n", indent, humanBytes(c.RawBytes), c.Compression)
	if ram := c.RAM; ram != nil {
		fmt.Fprintf(w, "%sRAM:     %s file (backend %s), %s of data, a chain of %d:\n", indent, humanBytes(ram.Bytes), ram.Backend, humanBytes(ram.DataBytes), len(ram.Chain))
		for i, l := range ram.Chain {
			name := string(l.Manifest)
			if i == len(ram.Chain)-1 {
				name = "this image"
			}
			role := "delta"
			if i == 0 {
				role = "base "
			}
			fmt.Fprintf(w, "%s  %s %s: %d pages in %d regions, %s, taken %s\n", indent, role, name, l.ChangedPages, l.Regions, humanBytes(l.StoredBytes), l.Created.Format("2006-01-02 15:04:05Z"))
		}
	}
	fmt.Fprintf(w, "%sQEMU:    %s (%s), %s, machine %s\n", indent, r.QEMUVersion, r.QEMUPackage, r.Arch, r.Machine)
	fmt.Fprintf(w, "%sCPUs:    %d x %s\n", indent, r.CPUs, r.CPUModel)
	fmt.Fprintf(w, "%smemory:  %s\n", indent, humanBytes(r.MemoryBytes))
	fmt.Fprintf(w, "%sdevices: %d PCI functions (%s)\n", indent, len(r.Devices), r.DevicesHash)
	for _, b := range r.Blocks {
		fmt.Fprintf(w, "%sdisk:    %s %s %s\n", indent, b.Device, b.Format, humanBytes(b.VirtualSize))
	}
	if r.VMGenID != "" {
		fmt.Fprintf(w, "%svmgenid: yes (generation ID %s at checkpoint; each restore gives the guest a fresh one)\n", indent, r.VMGenID)
	} else {
		fmt.Fprintf(w, "%svmgenid: no (clones of this snapshot start with the same RNG state: start the source with %s)\n", indent, vmstate.VMGenIDDeviceArg)
	}
}
