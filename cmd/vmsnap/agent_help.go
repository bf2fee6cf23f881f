package main

// agentLong is the long help of vmsnap agent, kept apart so that
// newAgentCmd reads on one screen.
const agentLong = `Run the node daemon (a Kubernetes DaemonSet on KVM nodes). It serves a JSON HTTP
API on a unix socket (mode 0660; give access to a group with --socket-group)
through which Jobs and controllers checkpoint, restore and prepare VMs on this
node, each an operation (202 with its id, followed in the events, cancelled by
DELETE):

  POST   /v1/checkpoints        {"vm":{"podUID","container","qmp","disk"},"image","diskImage","mode","keep"}
  POST   /v1/restores           {"vm":{"podUID","container","qmp"},"image":"REF@sha256:...","paused"}
  POST   /v1/prepares           {"image":"REF@sha256:...","qemuDir","namespace"}
  GET    /v1/operations[/ID]    DELETE /v1/operations/ID cancels
  GET    /v1/events[?operation=ID]   server-sent events of operation changes
  GET    /healthz  /readyz  /metrics (Prometheus)

VMs are named by pod UID and container name, with paths as seen inside that
container; the agent finds the container through the node's containerd and
maps the paths through its mounts. One operation per VM runs at a time (a
second gets BUSY), at most --max-concurrent per node. Each operation is
journaled in --state-dir: after a crash the agent continues any VM an
unfinished checkpoint had stopped. When a VM's container is deleted or
replaced, its operations are cancelled and forgotten.

Bounds on what a caller or a VM's QEMU can make the agent spend: a request's
"workers" may not exceed --max-workers and its "chunkSize" 16 MiB (larger
is refused with INVALID_INPUT); every operation ends after --operation-timeout
(counted from its acceptance, waiting for a slot included), failing and
putting its VM back as on any failure; a QMP message over 16 MiB ends the
connection with QMP_ERROR; a migration stream or mapped-ram staging file
larger than the VM's memory allows is aborted with QMP_ERROR, the VM
continued and the staging file freed.

Bounds on each caller (the callers of one namespace together, the node's
processes together): --max-connections-per-caller open connections,
counted from their accept (idle ones too; a request head at most 16 KiB),
--max-streams-per-caller event streams (one not read for 10s ends) and
--max-operations-per-caller operations pending or running, prepares
included. Beyond them, BUSY naming the flag.

Memory-file snapshots (a VM whose RAM is a shared memory-backend-file): a
checkpoint reads the RAM file QEMU names as its mem-path, opened as the disk
is: on a volume of the VM's own pod (below --kubelet-pods-dir/POD_UID; an
emptyDir with medium: Memory), without following links, mounts or "..", a
regular file, read-only; anything else is refused before the VM is stopped.
Encryption (docs/encryption-and-signing.md): --decryption-key-dir DIR holds each
namespace's private keys in DIR/NAMESPACE and the node's directly in DIR.
A restore, prepare or memory-file delta decrypts with the keys of the
namespace its VM or cache is in, and for an --admin-namespace caller also
with the node's; a checkpoint of a namespace's VM is encrypted for that
namespace's keys and every --encrypt-recipient.

POST /v1/prepares (vmsnap prepare --agent) materializes such a snapshot's RAM
file in the agent's cache of the caller's namespace, --state-dir/ram/NAMESPACE
(an admin may name another with "namespace"), under the same --allow-repository
and --layout-root checks as a restore; the operation's result ("prepare") holds
the QEMU arguments that map it ("qemuDir": the cache directory as the target
QEMU sees it). One cache
per namespace: QEMU before 8.2 opens a share=off file read-write, so a RAM file
is never shared across tenants. --ram-cache-max-bytes bounds each namespace's
cache. A prepare waits for one of the --max-concurrent slots as the others do,
and a cancelled one leaves no partial file in the cache.

Registry credentials come from $DOCKER_CONFIG or --registry-config (a mounted
dockerconfigjson secret), never from flags.

Who may do what (docs/security-model.md): a caller is placed by its
peer credentials. A process in a pod's container acts only on VMs in that
pod's namespace and sees and cancels only their operations; a process in a
namespace named with --admin-namespace, or on the node outside any
container, acts on every VM (the agent needs hostPID to see callers'
processes). Whoever calls, every image a request names must be under one of
--allow-repository HOST[:PORT]/PREFIX (none given: no registry at all), and
every oci: layout under --layout-root (none given: no layout at all);
anything else is FORBIDDEN (exit status 12) before the VM is touched.

Per tenant: a PREFIX component {namespace} is the caller's pod namespace, so
--allow-repository reg:5000/vms/{namespace} lets a caller in tenant-a use
reg:5000/vms/tenant-a/... and nothing of tenant-b's; admins match it with
any namespace. A caller in a pod has only LAYOUT_ROOT/NAMESPACE of the
layout root (admins the whole root). Plain entries are shared by every
caller. Every directory from --layout-root down must be the agent's alone
(its owner, not writable by group or others).

Signatures (docs/encryption-and-signing.md): with --sign-key every checkpoint's
manifests are signed as cosign sign --key signs them. A restore or prepare
request's image must carry a cosign signature by one of the keys that apply
to it: every --verify-key, and the KEY of every --require-signature
HOST[:PORT]/PREFIX=KEY whose PREFIX covers its repository (the rules of
--allow-repository, {namespace} matching any namespace whoever asks); no
key applying, no signature needed.
It is checked before anything else of the image is read: an unsigned or
wrongly signed image is AUTH_FAILED.`
