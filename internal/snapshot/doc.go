// Package snapshot is what a checkpoint, a restore, an inspect or a prune
// is, whoever asks: the CLI runs these operations in its own process, the
// agent's daemon runs them for requests on its socket, and other Go code
// may call them too. One file per verb: checkpoint.go, restore.go,
// stage.go (staging a state image for an init container and streaming it
// to QEMU), inspect.go and prune.go.
//
// The VM's files come opened (Handles): the daemon's resolver opens a pod's
// files beneath their volumes; the CLI's own paths are opened once here
// (OpenLocal). Paths are names for messages and annotations only.
//
// It sits in internal/ because the top level is fixed and it is the one
// layer above vmstate, rootfs and ociimage, which it composes; it does
// not import package agent (TestSnapshotDoesNotImportTheDaemon): a program
// that runs operations locally does not link the daemon. The JSON documents
// the operations return are package agent/api's, as the daemon's are.
package snapshot
