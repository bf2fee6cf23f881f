// Package qmp is vmsnap's client for the QEMU Machine Protocol: the JSON
// monitor over a unix socket through which vmsnap pauses, migrates and
// queries a VM.
//
// # Why not go-qemu's SocketMonitor
//
// vmsnap keeps go-qemu's vocabulary — its Monitor interface, Command, Event
// and Version types — but not its transport, qmp.SocketMonitor, which is
// unfit for a long-running daemon:
//
//   - It reads replies with a bufio.Scanner at its default 64 KiB token
//     limit; larger replies (query-qmp-schema is about 200 KiB on QEMU 7.2)
//     kill the connection.
//   - Its event channel is unbuffered and fed by the one goroutine that also
//     reads replies, so once anyone calls Events and then stops reading,
//     every later command waits forever.
//   - Nothing takes a context or a deadline: a QEMU that stops answering
//     hangs the caller.
//   - Connect reads the greeting and capabilities reply through a
//     json.Decoder and then starts the listener on a fresh bufio.Scanner, so
//     bytes the decoder had already buffered (an event sent right after
//     negotiation) are lost.
//   - Its typed companion, package raw, is generated from QEMU 2.11's schema
//     with strict enums: decoding fails on values QEMU 7.x sends, such as the
//     migration status "wait-unplug".
//
// This package's Client instead has a single reader goroutine that reads
// messages of up to MaxLineBytes (16 MiB, far above any real reply; a
// longer one ends the connection, since the QEMU of a tenant's pod is not
// trusted with the agent's memory), matches replies to commands by id (so concurrent
// Execute calls are safe), hands events to per-subscription queues without
// ever blocking (bounded in count and bytes), honours contexts on every
// blocking call, bounds the greeting and every command even when the
// context does not, and fails pending
// commands the moment the connection ends. Monitor adapts a Client to
// go-qemu's Monitor interface for code written against go-qemu.
//
// Every error carries an errcode code: VM_NOT_FOUND when nothing listens at
// the socket, BUSY when QEMU accepts the connection but never greets (it
// serves one client per socket and another is connected), QMP_ERROR for
// everything else. Refusals by QEMU wrap *Error, which keeps QEMU's error
// class.
//
// It is not a typed binding of the QMP schema (callers define the few
// argument and result structs they need), not a transport for TCP monitors,
// HMP or the guest agent, and not a reconnecting client: when QEMU closes
// the socket, Done closes, Err says why and the caller dials again if it
// wants to. DialFile dials a socket through a descriptor opened on it, so
// that a socket swapped after it was checked is not the one dialed, and a
// path longer than a socket address still works.
//
// Package qmptest provides a fake QEMU monitor for tests (real wire
// protocol, SCM_RIGHTS, events on demand, and hostile peers).
package qmp
