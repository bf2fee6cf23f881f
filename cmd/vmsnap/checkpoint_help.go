package main

// checkpointLong is the long help of vmsnap checkpoint, kept apart so that
// newCheckpointCmd reads on one screen.
const checkpointLong = `Capture the VM behind a QMP socket: record what the VM is, migrate its memory,
vCPU and device state through a pipe into zstd-compressed chunks, and store
them as an OCI image. With --disk, the VM's writable qcow2 overlay is captured
too, while the VM is stopped, as a second image. An image index in the --image
repository, the checkpoint index, lists them all: its digest (checkpoint.image)
names the whole checkpoint, and the --image tag names it. Give --disk-image
the same repository (with a tag of its own, or none) for a checkpoint that any
OCI copy tool copies whole; another repository of the same registry is linked
by its path, never by the registry's host (see docs/image-format.md).

Modes:
  snapshot  stop the VM, capture, continue it (the default)
  pause     stop the VM, capture, and leave it stopped on success (the source
            is about to be discarded); on any failure it is continued
  live      QEMU's background-snapshot: the VM keeps running and the image
            holds its state at the start; cannot be combined with --disk

State formats (--format):
  auto         memory-file for a VM whose RAM is a shared file (pause and
               snapshot mode); else mapped-ram in snapshot mode where QEMU
               has it (9.0 or later) and --staging-dir has room; else stream
  stream       QEMU's migration stream through a pipe (every QEMU, every mode)
  mapped-ram   QEMU writes a sparse file in --staging-dir with several threads;
               in snapshot mode the VM runs again as soon as QEMU is done, and
               the upload follows. Restoring it needs QEMU 9.0 or later.
  memory-file  for a VM started with
                 -object memory-backend-file,id=ram0,mem-path=FILE,share=on,size=SIZE
                 -machine memory-backend=ram0
               In snapshot mode the VM keeps running while QEMU pre-copies
               its RAM into vmsnap, which keeps the pages that changed since
               the parent checkpoint; QEMU stops the VM only for a final pass
               (milliseconds), and it runs again before anything is
               compressed or stored. In pause mode (or when a pre-copy fails
               before QEMU stopped the VM) QEMU sends only the device state
               (x-ignore-shared) and vmsnap reads FILE with the VM stopped.
               The result's ram.capture says which ("precopy", "scan"). The image
               holds the RAM page by page: a delta on its parent's layers, a
               fresh base past --max-chain deltas. The parent is the VM's
               last checkpoint as this node recorded it (--parent-records:
               its page map computed from the VM's memory, whatever tags
               each went under), or --parent, whose every page the delta
               inherits is checked against the VM's memory (SHA-256); never
               what a tag names (ram.parentTrust: "recorded", "verified").
               Restore it with vmsnap prepare (see its --help), which maps
               the RAM file instead of loading it.

Every image is stored by digest first; only once all of them and the checkpoint
index are stored do their tags move, the checkpoint's last: a failed checkpoint
never moves a tag.
Chunks are uploaded while QEMU still produces the stream; blobs the store
already has are skipped, so a repeated checkpoint uploads only what changed.

Registries: credentials come from a Docker config directory (--registry-config,
else $DOCKER_CONFIG, else ~/.docker), never from flags. TLS is verified (add a
private CA with --ca-file); plain HTTP only for hosts named with
--insecure-registry. Access is checked before the VM is stopped.
The printed image reference is pinned by digest; restore takes that form.

Through the node agent (a Kubernetes Job's way):
  vmsnap checkpoint --agent unix:///run/vmsnap/agent.sock --pod-uid UID --container qemu \
      --qmp /run/vm/qmp.sock --image REG/REPO:TAG --json --termination-log /dev/termination-log
prints progress on stderr while it waits and the same JSON result as a local
checkpoint; the agent pushes with its own registry credentials.
With --rootfs-image, the agent also captures the QEMU container's writable
layer. A --disk in that layer (not on a volume) then rides in the rootfs
image, at its path, and needs no --disk-image (given anyway, it is stored
there too); the result's disk.inRootfs says so.

With --keep N, once the checkpoint is committed, the state image's repository
keeps its N newest checkpoints and the older ones are deleted, as vmsnap
prune --keep N does; the result's "pruned" says what went. A failed prune
does not fail the checkpoint: "pruned.error" says why.

With --sign-key, every manifest the checkpoint stores (state, disk, rootfs)
is signed as cosign sign --key signs an image, before any tag moves: the
signature is at the tag sha256-HEX.sig in the image's repository, where
cosign verify --key finds it (see docs/encryption-and-signing.md).`
