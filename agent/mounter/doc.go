// Package mounter is the small privileged part of vmsnap's CSI node plugin:
// a daemon (vmsnap mounter) that bind-mounts a publication directory the
// agent prepared onto a kubelet volume target, and unmounts it, and that
// keeps a duplicate of the node's /dev/fuse descriptor so that the agent can
// restart without losing its FUSE connection.
//
// It is not for anything else: no network, no registry, no API server, no
// image parsing. Everything it is asked to do crosses a trust boundary
// (the agent may be compromised, the kubelet's directories are written by
// others), so:
//
//   - only root (and, when configured, the agent's group) may connect, as
//     the kernel recorded it at connect time (SO_PEERCRED);
//   - a request is one bounded message of a versioned JSON protocol;
//   - paths in a request are checked lexically, then opened by descriptor
//     beneath directories the mounter was configured with (openat2, no
//     symbolic links, no magic links), and the mount is made onto the
//     descriptor (open_tree, mount_setattr, move_mount), never onto a path
//     looked up again: a name swapped after the check cannot redirect it;
//   - an unmount goes through the opened target's /proc/self/fd link with
//     MNT_DETACH and asks nothing of the mounted file system, so a dead or
//     stalled FUSE server cannot hang it.
//
// The agent is the client (Client); the kubelet never talks to the mounter.
package mounter
