// Package e2e holds vmsnap's end-to-end tests and its benchmark: real QEMU
// guests (TCG), a real containerd with runc, Debian's docker-registry with
// TLS and htpasswd, and the vmsnap commands run as a user runs them, from
// the binary built from cmd/vmsnap (static, so that it also runs in the
// tests' busybox containers). BenchmarkE2E is `make bench`; it runs
// VMSNAP_BIN when set. The fast tests of the command line itself stay in
// cmd/vmsnap. It has no code outside its tests.
package e2e
