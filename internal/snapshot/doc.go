// Package snapshot is what a checkpoint, restore, prepare, stage/stream,
// inspect or prune is, whoever asks: the CLI runs these operations in its
// own process, the agent's daemon for requests, any Go program too. One file
// per verb. The VM's files come opened (Handles: the daemon's resolver opens
// them beneath the pod's volumes; OpenLocal for the CLI's paths); paths are
// names for messages only. It is the one layer above vmstate, rootfs and
// ociimage, which it composes, and must not import package agent
// (TestSnapshotDoesNotImportTheDaemon); its results are agent/api's
// documents. Not for flags (cmd/vmsnap) or finding VMs (agent).
package snapshot
