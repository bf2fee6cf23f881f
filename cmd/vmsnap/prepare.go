package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/vmsnap/vmsnap/agent"
	"github.com/vmsnap/vmsnap/agent/api"
	"github.com/vmsnap/vmsnap/internal/errcode"
	"github.com/vmsnap/vmsnap/internal/snapshot"
	"github.com/vmsnap/vmsnap/ociimage"
	"github.com/vmsnap/vmsnap/vmstate"
	"github.com/vmsnap/vmsnap/vmstate/ramfile"
)

type prepareFlags struct {
	cacheDir, qemuDir, copyTo, records, stateDir string
	agent, namespace                             string
	private, allowTag                            bool
	maxCache, maxMem                             int64
	timeout                                      time.Duration
	// localSet names the flags given that only a local prepare takes, in
	// the order they are refused through --agent.
	localSet []string
	stream   streamFlags
	registry registryFlags
	decrypt  decryptFlags
	verify   verifyFlags
}

// prepareLocalFlags are the agent's own with --agent: its cache and bounds.
var prepareLocalFlags = []string{"cache-dir", "max-cache-bytes", "parent-records", "max-guest-memory"}

func newPrepareCmd(out *globalOutput) *cobra.Command {
	var f prepareFlags
	c := &cobra.Command{
		Use:   "prepare REF@DIGEST [--cache-dir DIR] [--json]",
		Short: "Ready a memory-file snapshot's RAM file on this node and print the QEMU arguments that map it",
		Long:  prepareLong,
		Example: `  vmsnap prepare oci:/var/lib/snapshots:vm1@sha256:4f... --json
  vmsnap prepare --agent unix:///run/vmsnap/agent.sock registry.example.com/vms/vm1@sha256:4f... --json
  vmsnap prepare registry.example.com/vms/vm1@sha256:4f... --cache-dir /dev/shm/vmsnap --max-cache-bytes 68719476736`,
		Args: cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			f.localSet = nil
			for _, name := range prepareLocalFlags {
				if c.Flags().Changed(name) {
					f.localSet = append(f.localSet, name)
				}
			}
			return coded(runPrepare(c.Context(), out, f, args[0]))
		},
	}
	c.Flags().StringVar(&f.cacheDir, "cache-dir", "", "where RAM files are kept, one per snapshot (default "+snapshot.DefaultCacheDir()+")")
	c.Flags().BoolVar(&f.private, "private-volume", false, "the directories above --cache-dir are not shared with other users (a pod's own emptyDir, whose root Kubernetes makes world-writable): check only --cache-dir itself")
	c.Flags().Int64Var(&f.maxCache, "max-cache-bytes", 0, "once the file is ready, remove the least recently used others past this many allocated bytes (0: no bound)")
	c.Flags().StringVar(&f.qemuDir, "qemu-dir", "", "the cache directory as the target QEMU sees it (a container's mount), for the printed arguments (default --cache-dir)")
	c.Flags().StringVar(&f.copyTo, "copy-to", "", "give the VM its own copy of the RAM file in this directory, mapped shared (share=on), so that it can be checkpointed again as a delta on this snapshot; costs a copy of the snapshot's data, and the copy is yours to remove with the VM")
	c.Flags().StringVar(&f.records, "parent-records", snapshot.DefaultParentRecordsDir(), "with --copy-to: where to record the snapshot as the parent of the VM's next checkpoint (checkpoint's --parent-records)")
	c.Flags().Int64Var(&f.maxMem, "max-guest-memory", vmstate.DefaultMaxGuestMemory(), "refuse a snapshot that declares more guest memory than this many bytes, before fetching it (default: this node's memory)")
	c.Flags().BoolVar(&f.allowTag, "allow-tag", false, "accept a tag instead of a digest (the image may change under you)")
	c.Flags().DurationVar(&f.timeout, "timeout", 30*time.Minute, "give up after this long")
	c.Flags().StringVar(&f.stateDir, "state-dir", "", "where restore --to-dir staged this snapshot: record the result there (prepared.json) for vmsnap launch --state-dir")
	c.Flags().StringVar(&f.agent, "agent", "", "ask the node agent at unix:///PATH to prepare the file in its cache of your namespace instead of here")
	c.Flags().StringVar(&f.namespace, "namespace", "", "with --agent, for an admin caller: the namespace whose cache to fill (default the caller's)")
	f.stream.add(c, fmt.Sprintf("%d, the RAM file's regions fetched and written at once", ramfile.DefaultMaterializeWorkers))
	addFlagGroups(c, &f.registry, &f.decrypt, &f.verify)
	addOutputFlags(c, out, true)
	return c
}

func runPrepare(ctx context.Context, out *globalOutput, f prepareFlags, image string) error {
	ctx, cancel := context.WithTimeout(ctx, f.timeout)
	defer cancel()
	keys, err := prepareKeys(f)
	if err != nil {
		return err
	}
	if f.agent != "" {
		return prepareViaAgent(ctx, out, f, image)
	}
	if f.namespace != "" {
		return errcode.New(errcode.Usage, "--namespace names the agent's cache to fill: add --agent unix:///PATH/agent.sock")
	}
	if f.stateDir != "" {
		if err := checkStaged(ctx, f.stateDir, image); err != nil {
			return err
		}
	}
	return prepareHere(ctx, out, f, image, keys)
}

// prepareKeys are the decryption and signature keys of a local prepare;
// through --agent, giving any is a usage error (the agent has its own).
func prepareKeys(f prepareFlags) ([]ociimage.Option, error) {
	keys, err := f.decrypt.options()
	if err != nil {
		return nil, err
	}
	if f.agent != "" && len(f.decrypt.keys) > 0 {
		return nil, errcode.New(errcode.Usage, "through --agent, the agent decrypts with the keys of its own --decryption-key-dir: drop --decryption-key")
	}
	if f.agent != "" && len(f.verify.keys) > 0 {
		return nil, errcode.New(errcode.Usage, "through --agent, the agent verifies signatures with its own keys (--verify-key, --require-signature): drop --verify-key")
	}
	sigKeys, err := f.verify.options()
	if err != nil {
		return nil, err
	}
	return append(keys, sigKeys...), nil
}

func prepareViaAgent(ctx context.Context, out *globalOutput, f prepareFlags, image string) error {
	if len(f.localSet) > 0 {
		return errcode.New(errcode.Usage, "--%s is the agent's with --agent (its --state-dir/ram/NAMESPACE and --ram-cache-max-bytes): leave it out", f.localSet[0])
	}
	o, err := viaAgent(ctx, out, f.agent, func(c *agent.Client) (api.Operation, error) {
		return c.Prepare(ctx, api.PrepareRequest{Image: image, AllowTag: f.allowTag, Namespace: f.namespace, QEMUDir: f.qemuDir, Workers: f.stream.workers})
	})
	if err != nil {
		return err
	}
	report(out, o.Prepare, func(w io.Writer) { printPrepare(w, o.Prepare) })
	return nil
}

// checkStaged refuses to prepare another snapshot than the one restore
// --to-dir staged in stateDir: the result is for the staged snapshot, and
// launch checks that it is.
func checkStaged(ctx context.Context, stateDir, image string) error {
	d, err := snapshot.StagedDigest(ctx, stateDir)
	if err != nil {
		return err
	}
	if !strings.HasSuffix(image, "@"+d.String()) {
		return errcode.New(errcode.Usage, "%s staged snapshot %s, not %s: prepare the snapshot restore --to-dir staged there", stateDir, d, image)
	}
	return nil
}

func prepareHere(ctx context.Context, out *globalOutput, f prepareFlags, image string, keys []ociimage.Option) error {
	p := newPhasedProgress(out.stderr)
	defer p.finish()
	res, err := snapshot.Prepare(ctx, snapshot.PrepareSpec{
		Image: image, AllowTag: f.allowTag, CacheDir: f.cacheDir, PrivateParent: f.private, MaxCacheBytes: f.maxCache, QEMUDir: f.qemuDir, CopyTo: f.copyTo,
		Records: &vmstate.ParentRecords{Dir: f.records}, MaxGuestMemory: f.maxMem,
		Workers: f.stream.workers, Store: append(f.registry.options(), keys...), Progress: p.update,
	})
	p.finish()
	if err != nil {
		return err
	}
	if f.stateDir != "" {
		if err := snapshot.WritePrepared(f.stateDir, res); err != nil {
			return err
		}
	}
	report(out, res, func(w io.Writer) { printPrepare(w, res) })
	return nil
}

func printPrepare(w io.Writer, r *api.PrepareResult) {
	how := fmt.Sprintf("fetched %s", humanBytes(r.FetchedBytes))
	if r.DurationsMs["copy"] > 0 {
		how += fmt.Sprintf("; the VM's own copy took %.2fs", r.DurationsMs["copy"]/1000)
	}
	if r.FetchedBytes == 0 {
		how = "already on this node"
	}
	fmt.Fprintf(w, "RAM file %s ready (%s of memory, %s of data; %s) in %.2fs\n", r.MemoryFile, humanBytes(r.MemoryBytes), humanBytes(r.DataBytes), how, r.DurationsMs["total"]/1000)
	fmt.Fprintf(w, "start the target QEMU with its usual arguments plus:\n  %s -incoming defer\n", strings.Join(quoteArgs(r.QEMUArgs), " "))
	fmt.Fprintf(w, "then: vmsnap restore --qmp SOCK --image %s\n", r.Image)
	for _, e := range r.Evicted {
		fmt.Fprintf(w, "evicted from the cache: %s\n", e)
	}
}

// quoteArgs quotes for a POSIX shell the arguments that need it.
func quoteArgs(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		if a == "" || strings.ContainsAny(a, " \t\n'\"\\$`*?[]#~;&|<>(){}") {
			a = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
		out[i] = a
	}
	return out
}
