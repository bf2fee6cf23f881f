package main

// prepareLong is the long help of vmsnap prepare, kept apart so that
// newPrepareCmd reads on one screen.
const prepareLong = `Ready the restore of a snapshot in the memory-file format (checkpoint
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
same path in the QEMU container (or give --qemu-dir).`
