package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/ociimage/chunk"
	"github.com/vmsnap/vmsnap/vmstate"
	"github.com/vmsnap/vmsnap/vmstate/vmspec"
)

type streamFlags struct {
	chunkSize int
	workers   int
}

// add adds the flags to c; workersDefault says what an unset --workers
// means for c: chunk.DefaultWorkers, unless c has its own.
func (f *streamFlags) add(c *cobra.Command, workersDefault string) {
	c.Flags().IntVar(&f.chunkSize, "chunk-size", 8<<20, "average raw bytes per chunk, a power of two (each chunk is one compressed, digest-addressed blob, cut where the content says, between a quarter and 1.5 times this; grows for VMs over 64 GiB)")
	c.Flags().IntVar(&f.workers, "workers", 0, "chunks compressed, fetched or decompressed at once (default "+workersDefault+"; each one more holds up to two chunks in memory, 24 MiB at the default chunk size: raise it for a fast registry link with spare cores)")
}

// streamWorkers is the default of --workers where only the chunk codec
// uses it.
var streamWorkers = strconv.Itoa(chunk.DefaultWorkers)

func (f *streamFlags) options() chunk.StreamOptions {
	return chunk.StreamOptions{ChunkSize: f.chunkSize, Workers: f.workers}
}

// agentFlags make a command a client of the node agent (what a Job runs):
// the VM is named by pod UID and container, its paths as that container
// sees them.
type agentFlags struct {
	address, podUID, container string
}

func (f *agentFlags) add(c *cobra.Command) {
	c.Flags().StringVar(&f.address, "agent", "", "ask the node agent at unix:///PATH instead of acting here (a Job's way); --qmp and --disk are then paths inside the QEMU container")
	c.Flags().StringVar(&f.podUID, "pod-uid", "", "with --agent: the UID of the VM's pod (never its name)")
	c.Flags().StringVar(&f.container, "container", "", "with --agent: the name of the QEMU container in the pod")
}

func (f *agentFlags) vm(qmpPath, diskPath string) api.VMRef {
	return api.VMRef{PodUID: f.podUID, Container: f.container, QMPPath: qmpPath, DiskPath: diskPath}
}

// check refuses pod flags without --agent: they mean nothing locally.
func (f *agentFlags) check() error {
	if f.address == "" && (f.podUID != "" || f.container != "") {
		return errcode.New(errcode.Usage, "--pod-uid and --container name a VM for the node agent: add --agent unix:///PATH/agent.sock")
	}
	return nil
}

type checkpointFlags struct {
	qmp, image, disk, diskImage, mode string
	rootfsImage                       string
	format, stagingDir, parent        string
	parentRecords                     string
	parentRecordsSet                  bool
	keep, maxChain                    int
	timeout                           time.Duration
	stream                            streamFlags
	registry                          registryFlags
	encrypt                           encryptFlags
	decrypt                           decryptFlags
	sign                              signFlags
	agent                             agentFlags
}

func newCheckpointCmd(out *globalOutput) *cobra.Command {
	var f checkpointFlags
	c := &cobra.Command{
		Use:   "checkpoint --qmp SOCK --image REF [--disk PATH --disk-image REF] [--mode pause|snapshot|live]",
		Short: "Capture a running VM's state (and disk overlay) into OCI images",
		Long:  checkpointLong,
		Args:  cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			f.parentRecordsSet = c.Flags().Changed("parent-records")
			return coded(runCheckpoint(c.Context(), out, f))
		},
	}
	c.Flags().StringVar(&f.qmp, "qmp", "", "path of the QEMU monitor's unix socket (QEMU's -qmp unix:PATH,server=on,wait=off) (required)")
	c.Flags().StringVar(&f.image, "image", "", "where to store the VM state image: oci:DIR[:TAG] or HOST/REPO[:TAG] (required)")
	c.Flags().StringVar(&f.disk, "disk", "", "the VM's writable qcow2 overlay to capture as well")
	c.Flags().StringVar(&f.diskImage, "disk-image", "", "where to store the disk overlay image (required with --disk, unless the disk is in the container's writable layer captured by --rootfs-image)")
	c.Flags().StringVar(&f.rootfsImage, "rootfs-image", "", "with --agent: also capture the QEMU container's writable layer (its image plus one layer of changes) as an image here")
	c.Flags().StringVar(&f.mode, "mode", string(vmspec.ModeSnapshot), "pause, snapshot or live (see above)")
	c.Flags().StringVar(&f.format, "format", string(vmspec.FormatAuto), "auto, stream, mapped-ram or memory-file (see above)")
	c.Flags().StringVar(&f.parent, "parent", "", "memory-file: store the pages that changed since this checkpoint, REF@sha256:... in the --image repository, each page it vouches for checked against the VM's memory unless this node recorded it (default: the VM's last checkpoint as --parent-records holds it)")
	c.Flags().StringVar(&f.parentRecords, "parent-records", snapshot.DefaultParentRecordsDir(), "memory-file: the directory (yours, mode 0700) where this node records each VM's last checkpoint, the parent of its next; \"\" keeps none (every checkpoint a base, or on --parent)")
	c.Flags().IntVar(&f.maxChain, "max-chain", vmstate.DefaultMaxChain, "memory-file: how many deltas a chain may hold before the next checkpoint is a fresh base (each delta adds layers that a cold restore fetches)")
	c.Flags().StringVar(&f.stagingDir, "staging-dir", "", "where a mapped-ram checkpoint has QEMU write the state before it is stored (default $TMPDIR; sparse, about the guest's used memory)")
	c.Flags().IntVar(&f.keep, "keep", 0, "after the checkpoint, keep the `N` newest checkpoints of the --image repository and delete the older ones (see vmsnap prune; 0: prune nothing, through --agent: the agent's --keep)")
	c.Flags().DurationVar(&f.timeout, "timeout", 30*time.Minute, "give up (and continue the VM) after this long")
	f.stream.add(c, streamWorkers)
	addFlagGroups(c, &f.registry, &f.encrypt, &f.decrypt, &f.sign, &f.agent)
	addOutputFlags(c, out, true)
	return c
}

func runCheckpoint(ctx context.Context, out *globalOutput, f checkpointFlags) error {
	if f.qmp == "" || f.image == "" {
		return errcode.New(errcode.Usage, "checkpoint needs --qmp SOCK and --image REF")
	}
	if f.keep < 0 {
		return errcode.New(errcode.Usage, "--keep %d: give the number of checkpoints to keep, or 0 to prune nothing", f.keep)
	}
	if err := f.agent.check(); err != nil {
		return err
	}
	mode, err := vmspec.ParseMode(f.mode)
	if err != nil {
		return err
	}
	format, err := vmspec.ParseFormat(f.format)
	if err != nil {
		return err
	}
	if f.agent.address != "" && (f.encrypt.set() || len(f.decrypt.keys) > 0) {
		return errcode.New(errcode.Usage, "through --agent, the agent encrypts for the recipients of its own --encrypt-recipient (the operator's policy): drop --encrypt-recipient and --encrypt-dedup-key here")
	}
	encrypt, err := f.encrypt.options()
	if err != nil {
		return err
	}
	// A memory-file delta reads its parent's page map: encrypted, it needs
	// a key.
	decrypt, err := f.decrypt.options()
	if err != nil {
		return err
	}
	encrypt = append(encrypt, decrypt...)
	if f.agent.address != "" && f.sign.set() {
		return errcode.New(errcode.Usage, "through --agent, the agent signs with its own --sign-key (the operator's key): drop --sign-key here")
	}
	sign, err := f.sign.options()
	if err != nil {
		return err
	}
	encrypt = append(encrypt, sign...)
	if f.agent.address != "" && (format != vmspec.FormatAuto || f.stagingDir != "" || f.parentRecordsSet) {
		return errcode.New(errcode.Usage, "--format, --staging-dir and --parent-records apply to a local checkpoint: the node agent picks the format itself and keeps its own records")
	}
	if f.maxChain < 0 {
		return errcode.New(errcode.Usage, "--max-chain %d: give how many deltas a chain may hold", f.maxChain)
	}
	ctx, cancel := context.WithTimeout(ctx, f.timeout)
	defer cancel()
	var res *api.CheckpointResult
	if f.agent.address != "" {
		o, err := viaAgent(ctx, out, f.agent.address, func(c *agent.Client) (api.Operation, error) {
			return c.Checkpoint(ctx, api.CheckpointRequest{
				VM: f.agent.vm(f.qmp, f.disk), Image: f.image, DiskImage: f.diskImage, RootfsImage: f.rootfsImage, Mode: mode,
				ChunkSize: f.stream.chunkSize, Workers: f.stream.workers, Keep: f.keep, Parent: f.parent, MaxChain: f.maxChain,
			})
		})
		if err != nil {
			return err
		}
		res = o.Checkpoint
	} else {
		p := newPhasedProgress(out.stderr)
		res, err = snapshot.Checkpoint(ctx, snapshot.CheckpointSpec{
			QMPPath: f.qmp, DiskPath: f.disk, Image: f.image, DiskImage: f.diskImage, RootfsImage: f.rootfsImage, Mode: mode,
			Stream: f.stream.options(), Store: append(f.registry.options(), encrypt...), Progress: p.update,
			Format: format, StagingDir: f.stagingDir, Keep: f.keep, Parent: f.parent, MaxChain: f.maxChain,
			Records: &vmstate.ParentRecords{Dir: f.parentRecords},
		})
		p.finish()
		if err != nil {
			return err
		}
	}
	report(out, res, func(w io.Writer) { printCheckpoint(w, res) })
	return nil
}

func printCheckpoint(w io.Writer, r *api.CheckpointResult) {
	if r.Checkpoint != nil {
		fmt.Fprintf(w, "checkpoint: %s\n", r.Checkpoint.Image)
	}
	fmt.Fprintf(w, "vmstate: %s\n", r.VMState.Image)
	fmt.Fprintf(w, "  %s of state stored as %s in %d chunks (%s new) in %.2fs; guest downtime %.0f ms\n",
		humanBytes(r.VMState.RawBytes), humanBytes(r.VMState.StoredBytes), r.VMState.Chunks,
		humanBytes(r.VMState.UploadedBytes), r.TotalMs/1000, r.DowntimeMs)
	if ram := r.VMState.RAM; ram != nil {
		last := ram.Chain[len(ram.Chain)-1]
		kind := fmt.Sprintf("a delta on %s (chain of %d)", ram.Parent, len(ram.Chain))
		if ram.Parent == "" {
			kind = "a base"
			if ram.BaseNote != "" {
				kind += " (" + ram.BaseNote + ")"
			}
		}
		fmt.Fprintf(w, "  memory-file: %s of RAM, %s of data; this checkpoint stored %d changed pages in %d regions, %s; RAM read by %s\n",
			humanBytes(ram.Bytes), humanBytes(ram.DataBytes), last.ChangedPages, last.Regions, kind, ram.Capture)
		if ram.ParentTrust != "" {
			fmt.Fprintf(w, "  parent %s", ram.ParentTrust)
			if ram.ParentTrust == vmstate.ParentVerified {
				fmt.Fprintf(w, " against the VM's memory: %d pages it vouched for did not match and were stored", ram.RefutedPages)
			}
			fmt.Fprintln(w)
		}
		for _, note := range []string{ram.CaptureNote, ram.RecordNote} {
			if note != "" {
				fmt.Fprintf(w, "  %s\n", note)
			}
		}
	}
	if d := r.Disk; d != nil {
		if d.Image != "" {
			fmt.Fprintf(w, "disk:    %s\n", d.Image)
			fmt.Fprintf(w, "  %s overlay stored as %s (%s new)\n", humanBytes(d.RawBytes), humanBytes(d.StoredBytes), humanBytes(d.UploadedBytes))
		}
		if in := d.InRootfs; in != nil {
			if d.Image == "" {
				fmt.Fprintf(w, "disk:    in the rootfs image, at %s\n", in.Path)
				fmt.Fprintf(w, "  %s overlay in the container's writable layer\n", humanBytes(d.RawBytes))
			} else {
				fmt.Fprintf(w, "  also in the rootfs image, at %s\n", in.Path)
			}
		}
	}
	if r.Rootfs != nil {
		fmt.Fprintf(w, "rootfs:  %s\n", r.Rootfs.Image)
		fmt.Fprintf(w, "  container %s: one %s layer of %s on %s\n", r.Rootfs.ContainerID, r.Rootfs.Compression, humanBytes(r.Rootfs.LayerBytes), r.Rootfs.BaseImage)
	}
	state := "running"
	if !r.VMRunning {
		state = "stopped"
	}
	fmt.Fprintf(w, "the VM is %s (mode %s)\n", state, r.Mode)
	if r.Pruned != nil {
		printPrune(w, r.Pruned)
	}
}

// viaAgent starts an operation on the node agent and follows it to its
// end, with progress lines on stderr, and returns it or its error.
func viaAgent(ctx context.Context, out *globalOutput, address string, start func(*agent.Client) (api.Operation, error)) (api.Operation, error) {
	c, err := agent.NewClient(address)
	if err != nil {
		return api.Operation{}, err
	}
	o, err := start(c)
	if err != nil {
		return o, fromAgent(err)
	}
	of := "pod " + o.VM.PodUID
	if o.Kind == api.KindPrepare {
		of = "namespace " + o.Namespace
	}
	fmt.Fprintf(out.stderr, "vmsnap: %s %s of %s accepted by the agent (%s)\n", o.Kind, o.ID, of, o.State)
	last := o.State
	var lastPrint time.Time
	o, err = c.Wait(ctx, o.ID, func(o api.Operation) {
		switch {
		case o.State != last:
			fmt.Fprintf(out.stderr, "vmsnap: %s %s\n", o.Kind, o.State)
			last = o.State
		case o.Progress != nil && time.Since(lastPrint) > 2*time.Second:
			fmt.Fprintf(out.stderr, "vmsnap: %s %s: %s\n", o.Kind, o.Progress.Phase, humanBytes(o.Progress.Bytes))
			lastPrint = time.Now()
		}
	})
	if err != nil {
		return o, fromAgent(err)
	}
	return o, fromAgent(agent.Result(o))
}

// fromAgent writes the request fields an agent's error names as this CLI's
// flags, as for a local error: the error crossed the agent's API as text,
// its fields quoted (errcode.Field).
func fromAgent(err error) error {
	e, ok := err.(*api.Error)
	if !ok {
		return err
	}
	c := *e
	c.Message = errcode.RenameQuotedFields(c.Message, flagOf)
	c.Details = nil
	for _, d := range e.Details {
		c.Details = append(c.Details, errcode.RenameQuotedFields(d, flagOf))
	}
	return &c
}
