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

type streamFlags struct {
	chunkSize int
	workers   int
}

func (f *streamFlags) add(c *cobra.Command) {
	c.Flags().IntVar(&f.chunkSize, "chunk-size", 4<<20, "raw bytes per chunk (each chunk is one compressed, digest-addressed blob)")
	c.Flags().IntVar(&f.workers, "workers", 0, "chunks compressed, stored, fetched or decompressed at once (default: number of CPUs, at least 2)")
}

func (f *streamFlags) options(p *progress) vmstate.StreamOptions {
	return vmstate.StreamOptions{ChunkSize: f.chunkSize, Workers: f.workers, Progress: p.update}
}

type checkpointFlags struct {
	qmp, image, disk, diskImage, mode string
	timeout                           time.Duration
	stream                            streamFlags
}

func newCheckpointCmd(out *globalOutput) *cobra.Command {
	var f checkpointFlags
	c := &cobra.Command{
		Use:   "checkpoint --qmp SOCK --image REF [--disk PATH --disk-image REF] [--mode pause|snapshot|live]",
		Short: "Capture a running VM's state (and disk overlay) into OCI images",
		Long: `Capture the VM behind a QMP socket: record what the VM is, migrate its memory,
vCPU and device state through a pipe into zstd-compressed chunks, and store
them as an OCI image. With --disk, the VM's writable qcow2 overlay is captured
too, while the VM is stopped, as a second image linked from the first.

Modes:
  snapshot  stop the VM, capture, continue it (the default)
  pause     stop the VM, capture, and leave it stopped on success (the source
            is about to be discarded); on any failure it is continued
  live      QEMU's background-snapshot: the VM keeps running and the image
            holds its state at the start; cannot be combined with --disk

The manifest is stored last: a failed checkpoint never leaves a tag behind.
The printed image reference is pinned by digest; restore takes that form.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			return coded(runCheckpoint(c.Context(), out, f))
		},
	}
	c.Flags().StringVar(&f.qmp, "qmp", "", "path of the QEMU monitor's unix socket (QEMU's -qmp unix:PATH,server=on,wait=off) (required)")
	c.Flags().StringVar(&f.image, "image", "", "where to store the VM state image: oci:DIR[:TAG] or HOST/REPO[:TAG] (required)")
	c.Flags().StringVar(&f.disk, "disk", "", "the VM's writable qcow2 overlay to capture as well")
	c.Flags().StringVar(&f.diskImage, "disk-image", "", "where to store the disk overlay image (required with --disk)")
	c.Flags().StringVar(&f.mode, "mode", string(vmstate.ModeSnapshot), "pause, snapshot or live (see above)")
	c.Flags().DurationVar(&f.timeout, "timeout", 30*time.Minute, "give up (and continue the VM) after this long")
	f.stream.add(c)
	addOutputFlags(c, out, true)
	return c
}

// checkpointDoc is the JSON result of a checkpoint.
type checkpointDoc struct {
	VMState    vmstateDoc `json:"vmstate"`
	Disk       *diskDoc   `json:"disk,omitempty"`
	Mode       string     `json:"mode"`
	DowntimeMs float64    `json:"downtimeMs"`
	VMRunning  bool       `json:"vmRunning"`
	TotalMs    float64    `json:"totalMs"`
}

type vmstateDoc struct {
	Image         string             `json:"image"`
	Digest        string             `json:"digest"`
	RawBytes      int64              `json:"rawBytes"`
	StoredBytes   int64              `json:"storedBytes"`
	UploadedBytes int64              `json:"uploadedBytes"`
	Chunks        int                `json:"chunks"`
	QEMUVersion   string             `json:"qemuVersion"`
	Machine       string             `json:"machine"`
	MemoryBytes   int64              `json:"memoryBytes"`
	DurationsMs   map[string]float64 `json:"durationsMs"`
}

type diskDoc struct {
	Image         string             `json:"image"`
	Digest        string             `json:"digest"`
	Path          string             `json:"path"`
	RawBytes      int64              `json:"rawBytes"`
	StoredBytes   int64              `json:"storedBytes"`
	UploadedBytes int64              `json:"uploadedBytes"`
	Chunks        int                `json:"chunks"`
	VirtualSize   uint64             `json:"virtualSize"`
	BackingFile   string             `json:"backingFile,omitempty"`
	DurationsMs   map[string]float64 `json:"durationsMs"`
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func runCheckpoint(ctx context.Context, out *globalOutput, f checkpointFlags) error {
	if f.qmp == "" || f.image == "" {
		return errcode.New(errcode.Usage, "checkpoint needs --qmp SOCK and --image REF")
	}
	if (f.disk == "") != (f.diskImage == "") {
		return errcode.New(errcode.Usage, "--disk and --disk-image go together: the overlay to capture and where to store it")
	}
	mode, err := vmstate.ParseMode(f.mode)
	if err != nil {
		return err
	}
	if mode == vmstate.ModeLive && f.disk != "" {
		return errcode.New(errcode.Usage, "--mode live keeps the VM running, so its disk would not match the captured memory: use --mode snapshot or pause with --disk")
	}
	ref, err := ociimage.ParseReference(f.image)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, f.timeout)
	defer cancel()
	repo, err := ociimage.Open(ctx, ref)
	if err != nil {
		return err
	}
	var diskRepo ociimage.Repository
	if f.disk != "" {
		dref, err := ociimage.ParseReference(f.diskImage)
		if err != nil {
			return err
		}
		if diskRepo, err = ociimage.Open(ctx, dref); err != nil {
			return err
		}
		// Refuse a bad overlay before the VM is touched.
		if _, err := rootfs.InspectOverlay(f.disk); err != nil {
			return err
		}
	}

	mon, err := qmp.Dial(ctx, f.qmp)
	if err != nil {
		return err
	}
	defer mon.Close()

	p := newProgress(out.stderr, "checkpoint")
	opts := vmstate.CheckpointOptions{Mode: mode, Stream: f.stream.options(p)}
	var disk *rootfs.CaptureResult
	if diskRepo != nil {
		opts.WhileStopped = func(ctx context.Context) (map[string]string, error) {
			p.finish()
			dp := newProgress(out.stderr, "disk")
			defer dp.finish()
			var err error
			disk, err = rootfs.Capture(ctx, f.disk, diskRepo, f.stream.options(dp))
			if err != nil {
				return nil, err
			}
			return map[string]string{ociimage.AnnotationDiskImage: disk.Image.String()}, nil
		}
	}
	res, err := vmstate.Checkpoint(ctx, mon, repo, opts)
	p.finish()
	if err != nil {
		return err
	}

	doc := checkpointDoc{
		VMState: vmstateDoc{
			Image:         res.Image.String(),
			Digest:        res.Manifest.Digest.String(),
			RawBytes:      res.Stream.RawBytes,
			StoredBytes:   res.Stream.StoredBytes,
			UploadedBytes: res.Stream.UploadedBytes,
			Chunks:        len(res.Stream.Layers),
			QEMUVersion:   res.Config.Record.QEMUVersion,
			Machine:       res.Config.Record.Machine,
			MemoryBytes:   res.Config.Record.MemoryBytes,
			DurationsMs: map[string]float64{
				"prepare": ms(res.Durations.Prepare), "stream": ms(res.Durations.Stream),
				"push": ms(res.Durations.Push), "total": ms(res.Durations.Total),
			},
		},
		Mode:       string(mode),
		DowntimeMs: ms(res.Downtime),
		VMRunning:  res.VMRunning,
		TotalMs:    ms(res.Durations.Total),
	}
	if disk != nil {
		doc.Disk = &diskDoc{
			Image: disk.Image.String(), Digest: disk.Manifest.Digest.String(), Path: f.disk,
			RawBytes: disk.Stream.RawBytes, StoredBytes: disk.Stream.StoredBytes, UploadedBytes: disk.Stream.UploadedBytes,
			Chunks: len(disk.Stream.Layers), VirtualSize: disk.Config.VirtualSize, BackingFile: disk.Config.BackingFile,
			DurationsMs: map[string]float64{"total": ms(disk.Duration)},
		}
	}
	report(out, doc, func(w io.Writer) {
		fmt.Fprintf(w, "vmstate: %s\n", doc.VMState.Image)
		fmt.Fprintf(w, "  %s of state stored as %s in %d chunks (%s new) in %.2fs; guest downtime %.0f ms\n",
			humanBytes(doc.VMState.RawBytes), humanBytes(doc.VMState.StoredBytes), doc.VMState.Chunks,
			humanBytes(doc.VMState.UploadedBytes), doc.TotalMs/1000, doc.DowntimeMs)
		if doc.Disk != nil {
			fmt.Fprintf(w, "disk:    %s\n", doc.Disk.Image)
			fmt.Fprintf(w, "  %s overlay stored as %s (%s new)\n", humanBytes(doc.Disk.RawBytes), humanBytes(doc.Disk.StoredBytes), humanBytes(doc.Disk.UploadedBytes))
		}
		state := "running"
		if !doc.VMRunning {
			state = "stopped"
		}
		fmt.Fprintf(w, "the VM is %s (mode %s)\n", state, doc.Mode)
	})
	return nil
}
