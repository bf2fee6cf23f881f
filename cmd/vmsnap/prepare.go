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
	"github.com/vmsnap/vmsnap/vmstate"
)

func newPrepareCmd(out *globalOutput) *cobra.Command {
	var (
		reg      registryFlags
		decrypt  decryptFlags
		verify   verifyFlags
		stream   streamFlags
		cacheDir string
		private  bool
		maxCache int64
		qemuDir  string
		copyTo   string
		records  string
		maxMem   int64
		allowTag bool
		timeout  time.Duration
		agentAt  string
		ns       string
		stateDir string
	)
	c := &cobra.Command{
		Use:   "prepare REF@DIGEST [--cache-dir DIR] [--json]",
		Short: "Ready a memory-file snapshot's RAM file on this node and print the QEMU arguments that map it",
		Long: `Ready the restore of a snapshot in the memory-file format (checkpoint
--format memory-file, which auto picks for a VM whose RAM is a shared
memory-backend-file) on this node. REF names the VM state image or its
checkpoint (the checkpoint index's digest):

  1. vmsnap prepare REF@sha256:... --json
     materializes the snapshot's RAM file in the cache directory, every region
     verified against its digest before it is written, or finds it there
     (fetchedBytes 0), and prints the arguments the target QEMU needs:
       {"qemuArgs": ["-object", "memory-backend-file,...,share=off", "-machine",
        "memory-backend=ram0"], "memoryFile": PATH, "fetchedBytes": N, ...}
  2. start the target QEMU with its usual arguments, then qemuArgs, then
     -incoming defer;
  3. vmsnap restore --qmp SOCK --image REF@sha256:... [--cache-dir DIR]
     loads the device state (milliseconds, whatever the guest's size) and the
     guest runs, its pages faulting in from the file as it touches them.
     With the cache prepare filled, and the same repository, the device state
     prepare kept there is read, not the store.

QEMU maps the file private (share=off): the guest's writes stay in the VM and
the file is never changed, so several VMs restored from one snapshot on one
node share the pages they only read. The cache holds one file per snapshot,
named by its manifest digest, complete or absent: an interrupted prepare
leaves nothing, and concurrent prepares of one snapshot wait for each other.

To pause and resume the same VM again and again, give it its own copy with
--copy-to DIR: the copy (DIR/vm-RANDOM.sha256-HEX.ram, only the data copied)
is mapped shared, so the restored VM's RAM is a shared file again. The copy is
checked page by page against the snapshot's page map and recorded in
--parent-records as that file's last checkpoint: the VM's next checkpoint is a
delta of the pages it changed. The copy costs time in proportion to the
snapshot's data (durationsMs.copy); without it, a restored VM is checkpointed
with the stream.

Every page of a delta's materialized file is checked against the image's page
map (xxhash64 and SHA-256, holes included) before any QEMU maps it: a snapshot
built on a parent whose layers do not hold what its map says fails with
DIGEST_MISMATCH. A snapshot that declares more guest memory than
--max-guest-memory (default: this node's memory) is refused (INVALID_INPUT)
before a layer of it is fetched.

Trust: QEMU before 8.2 opens a share=off file read-write (its readonly=on
would make the guest's RAM read-only), so a compromised QEMU could change
the file under every VM that maps it: keep a cache per tenant. For snapshots
taken by QEMU 8.2 or later the arguments add readonly=on,rom=off, QEMU opens
the file read-only, and the file is mode 0444.

The cache directory is created with mode 0700 and must be yours; every
directory above it must be yours or root's and writable by nobody else, or
root's and sticky like /dev/shm (FORBIDDEN otherwise: a file someone else put
there would become a VM's memory). The default is on tmpfs, whose pages QEMU maps
directly; a cache on disk works too, through the page cache.

Registry access works as for checkpoint (--registry-config, --ca-file,
--insecure-registry). With --verify-key, the image must carry a cosign
signature by one of the keys (as for restore, see its --help), checked
before anything else is read or a cached file is used: AUTH_FAILED if not.

Through the node agent (--agent unix:///run/vmsnap/agent.sock): the agent
prepares the file in its cache of the caller's namespace
(AGENT_STATE_DIR/ram/NAMESPACE; an admin may name another with --namespace),
with its own registry credentials and only for images its --allow-repository
and --layout-root allow (FORBIDDEN otherwise), and bounds the cache with its
--ram-cache-max-bytes; --cache-dir and --max-cache-bytes are then the
agent's, not flags. --qemu-dir names that cache as the target QEMU sees it.
In Kubernetes the restore pod prepares into a volume of its own instead
(vmsnap manifests --part restore --memory-file): see vmsnap manifests --help.

For vmsnap launch (a restored pod's QEMU): after vmsnap restore --to-dir DIR
staged the snapshot's device state, vmsnap prepare REF@sha256:... --cache-dir
RAM_DIR --state-dir DIR records its result in DIR/prepared.json, and vmsnap
launch --state-dir DIR starts QEMU with those arguments and -incoming defer
and loads the device state over QMP. The RAM volume must be mounted at the
same path in the QEMU container (or give --qemu-dir).`,
		Example: `  vmsnap prepare oci:/var/lib/snapshots:vm1@sha256:4f... --json
  vmsnap prepare --agent unix:///run/vmsnap/agent.sock registry.example.com/vms/vm1@sha256:4f... --json
  vmsnap prepare registry.example.com/vms/vm1@sha256:4f... --cache-dir /dev/shm/vmsnap --max-cache-bytes 68719476736`,
		Args: cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			ctx, cancel := context.WithTimeout(c.Context(), timeout)
			defer cancel()
			keys, err := decrypt.options()
			if err != nil {
				return coded(err)
			}
			if agentAt != "" && len(decrypt.keys) > 0 {
				return coded(errcode.New(errcode.Usage, "through --agent, the agent decrypts with the keys of its own --decryption-key-dir: drop --decryption-key"))
			}
			if agentAt != "" && len(verify.keys) > 0 {
				return coded(errcode.New(errcode.Usage, "through --agent, the agent verifies signatures with its own keys (--verify-key, --require-signature): drop --verify-key"))
			}
			sigKeys, err := verify.options()
			if err != nil {
				return coded(err)
			}
			keys = append(keys, sigKeys...)
			if agentAt != "" {
				for _, f := range []string{"cache-dir", "max-cache-bytes", "parent-records", "max-guest-memory"} {
					if c.Flags().Changed(f) {
						return coded(errcode.New(errcode.Usage, "--%s is the agent's with --agent (its --state-dir/ram/NAMESPACE and --ram-cache-max-bytes): leave it out", f))
					}
				}
				cl, err := agent.NewClient(agentAt)
				if err != nil {
					return coded(err)
				}
				fmt.Fprintf(out.stderr, "vmsnap: asking the agent at %s to prepare %s\n", agentAt, args[0])
				res, err := cl.Prepare(ctx, api.PrepareRequest{Image: args[0], AllowTag: allowTag, Namespace: ns, QEMUDir: qemuDir, Workers: stream.workers})
				if err != nil {
					return coded(fromAgent(err))
				}
				report(out, res, func(w io.Writer) { printPrepare(w, res) })
				return nil
			}
			if ns != "" {
				return coded(errcode.New(errcode.Usage, "--namespace names the agent's cache to fill: add --agent unix:///PATH/agent.sock"))
			}
			if stateDir != "" {
				// Staged first (restore --to-dir): the result is for the
				// staged snapshot, and launch checks that it is.
				d, err := snapshot.StagedDigest(ctx, stateDir)
				if err != nil {
					return coded(err)
				}
				if !strings.HasSuffix(args[0], "@"+d.String()) {
					return coded(errcode.New(errcode.Usage, "%s staged snapshot %s, not %s: prepare the snapshot restore --to-dir staged there", stateDir, d, args[0]))
				}
			}
			p := newPhasedProgress(out.stderr)
			defer p.finish()
			res, err := snapshot.Prepare(ctx, snapshot.PrepareSpec{
				Image: args[0], AllowTag: allowTag, CacheDir: cacheDir, PrivateParent: private, MaxCacheBytes: maxCache, QEMUDir: qemuDir, CopyTo: copyTo,
				Records: &vmstate.ParentRecords{Dir: records}, MaxGuestMemory: maxMem,
				Workers: stream.workers, Store: append(reg.options(), keys...), Progress: p.update,
			})
			p.finish()
			if err != nil {
				return coded(err)
			}
			if stateDir != "" {
				if err := snapshot.WritePrepared(stateDir, res); err != nil {
					return coded(err)
				}
			}
			report(out, res, func(w io.Writer) { printPrepare(w, res) })
			return nil
		},
	}
	c.Flags().StringVar(&cacheDir, "cache-dir", "", "where RAM files are kept, one per snapshot (default "+snapshot.DefaultCacheDir()+")")
	c.Flags().BoolVar(&private, "private-volume", false, "the directories above --cache-dir are not shared with other users (a pod's own emptyDir, whose root Kubernetes makes world-writable): check only --cache-dir itself")
	c.Flags().Int64Var(&maxCache, "max-cache-bytes", 0, "once the file is ready, remove the least recently used others past this many allocated bytes (0: no bound)")
	c.Flags().StringVar(&qemuDir, "qemu-dir", "", "the cache directory as the target QEMU sees it (a container's mount), for the printed arguments (default --cache-dir)")
	c.Flags().StringVar(&copyTo, "copy-to", "", "give the VM its own copy of the RAM file in this directory, mapped shared (share=on), so that it can be checkpointed again as a delta on this snapshot; costs a copy of the snapshot's data, and the copy is yours to remove with the VM")
	c.Flags().StringVar(&records, "parent-records", snapshot.DefaultParentRecordsDir(), "with --copy-to: where to record the snapshot as the parent of the VM's next checkpoint (checkpoint's --parent-records)")
	c.Flags().Int64Var(&maxMem, "max-guest-memory", vmstate.DefaultMaxGuestMemory(), "refuse a snapshot that declares more guest memory than this many bytes, before fetching it (default: this node's memory)")
	c.Flags().BoolVar(&allowTag, "allow-tag", false, "accept a tag instead of a digest (the image may change under you)")
	c.Flags().DurationVar(&timeout, "timeout", 30*time.Minute, "give up after this long")
	c.Flags().StringVar(&stateDir, "state-dir", "", "where restore --to-dir staged this snapshot: record the result there (prepared.json) for vmsnap launch --state-dir")
	c.Flags().StringVar(&agentAt, "agent", "", "ask the node agent at unix:///PATH to prepare the file in its cache of your namespace instead of here")
	c.Flags().StringVar(&ns, "namespace", "", "with --agent, for an admin caller: the namespace whose cache to fill (default the caller's)")
	stream.add(c)
	reg.add(c)
	decrypt.add(c)
	verify.add(c)
	addOutputFlags(c, out, true)
	return c
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
