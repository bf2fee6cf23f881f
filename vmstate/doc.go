// Package vmstate is the VM state stream: what a QEMU VM is, and its state
// moved in and out of an image store over QMP.
//
// It owns:
//
//   - the compatibility record (Record, ReadRecord, Compare): QEMU version,
//     architecture, machine type, vCPUs and CPU model (with the CPUID
//     feature words on x86), memory, PCI and block devices, read from the
//     source at checkpoint and from a QEMU waiting with -incoming defer at
//     restore, compared before a byte is sent;
//   - Checkpoint and Restore: migration settings, getfd + migrate fd: into a
//     pipe, one stop, save, continue sequence for every format, MIGRATION
//     events with query-migrate as the fallback; a VM that was running runs
//     again on any failure, and the incoming migration starts only after
//     the first chunk verifies;
//   - the formats (Format): QEMU's stream, QEMU 9.0+'s mapped-ram file
//     (staged through an fdset, chunked at fixed offsets), and memory-file
//     for a VM whose RAM is a shared memory-backend-file (package
//     vmstate/ramfile), whose delta builds on the parent the node recorded
//     (ParentRecords) or on a named parent checked against memory, never on
//     what a tag names; Prepare materializes such an image into a node cache;
//   - the one bound on a checkpoint's state and on every staging file
//     (bounds.go, staging*.go: the VM's memory + 10% + 256 MiB), reserved
//     before the operation and enforced while anyone may write the file.
//
// It is not for talking QMP (package qmp), storing blobs (package ociimage,
// behind the chunk codec's interfaces), the disk overlay (package
// vmstate/disk) or finding VMs on a node (package agent). It must never
// open a path QEMU reports without checking that QEMU maps that very file.
// docs/memory-file.md and docs/design.md describe it for users.
package vmstate
