#!/usr/bin/env bash
# The vmsnap demo: boot the test guest, checkpoint it into an OCI layout on
# local disk, throw the VM away, restore it into a fresh QEMU and show that
# the guest did not notice (same boot id, same memory, same disk, its
# counter carrying on).
#
# usage: testdata/demo.sh VMSNAP_BINARY GUEST_DIR   (make demo does this)
set -euo pipefail

VMSNAP=$(realpath "$1")
GUEST=$(realpath "$2")
WORK=$(mktemp -d /tmp/vmsnap-demo.XXXXXX)
PIDS=()
cleanup() {
	for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
	rm -rf "$WORK"
}
trap cleanup EXIT

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

# The QEMU command line, the same for the source and the restore target
# (which adds -incoming defer). TCG: no /dev/kvm needed.
qemu() {
	local name=$1; shift
	qemu-system-x86_64 -accel tcg -machine pc -m 256 -smp 1 \
		-nodefaults -no-user-config -display none -no-reboot \
		-kernel "$GUEST/vmlinuz" -initrd "$GUEST/initrd" \
		-append "console=ttyS0 panic=-1 quiet no_timer_check vmsnap.mem_mb=16" \
		-serial "file:$WORK/$name.serial" \
		-qmp "unix:$WORK/$name.qmp,server=on,wait=off" \
		-drive "file=$WORK/$name/overlay.qcow2,if=virtio,format=qcow2,cache=writeback" \
		"$@" 2>"$WORK/$name.stderr" &
	PIDS+=($!)
	disown $! # we kill it ourselves; no job-control noise
}

# status NAME: the guest's latest status line; wait_status NAME AFTER:
# wait for a line with a counter greater than AFTER.
status() { { grep -a '^VMSNAP counter=' "$WORK/$1.serial" 2>/dev/null || true; } | tail -n1 | tr -d '\r'; }
field() { sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<<" $1"; }
wait_status() {
	local name=$1 after=$2 line
	for _ in $(seq 1 600); do
		line=$(status "$name")
		if [[ -n $line && $(field "$line" counter) -gt $after ]]; then echo "$line"; return; fi
		sleep 0.2
	done
	echo "timed out waiting for $name's guest; QEMU said:" >&2
	cat "$WORK/$name.stderr" >&2
	exit 1
}

say "1. Boot the source VM (a Debian kernel and a busybox userland, under TCG)"
mkdir -p "$WORK/source" "$WORK/target"
qemu-img create -q -f qcow2 "$WORK/base.qcow2" 64M
ln -s ../base.qcow2 "$WORK/source/base.qcow2"
ln -s ../base.qcow2 "$WORK/target/base.qcow2"
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 "$WORK/source/overlay.qcow2"
qemu source
wait_status source 1 >/dev/null
echo "source guest says:  $(status source)"

say "2. Checkpoint it (mode pause: the source stays stopped on success)"
set -x
"$VMSNAP" checkpoint --qmp "$WORK/source.qmp" --mode pause \
	--image "oci:$WORK/snapshots:demo" \
	--disk "$WORK/source/overlay.qcow2" --disk-image "oci:$WORK/snapshots:demo-disk" \
	--json >"$WORK/checkpoint.json"
{ set +x; } 2>/dev/null
cat "$WORK/checkpoint.json"
BEFORE=$(status source)
IMAGE=$(sed -n '/"vmstate"/,/}/s/.*"image": "\(.*\)".*/\1/p' "$WORK/checkpoint.json" | head -n1)
DISK_IMAGE=$(sed -n '/"disk"/,/}/s/.*"image": "\(.*\)".*/\1/p' "$WORK/checkpoint.json" | head -n1)
kill -9 "${PIDS[0]}"
echo "source VM discarded; its last words: $BEFORE"

say "3. Inspect the snapshot"
"$VMSNAP" inspect "$IMAGE"

say "4. Restore: disk overlay first, then QEMU with -incoming defer, then the state"
set -x
"$VMSNAP" restore --disk-image "$DISK_IMAGE" --disk "$WORK/target/overlay.qcow2"
{ set +x; } 2>/dev/null
qemu target -incoming defer
for _ in $(seq 1 100); do [[ -S $WORK/target.qmp ]] && break; sleep 0.1; done
set -x
"$VMSNAP" restore --qmp "$WORK/target.qmp" --image "$IMAGE"
{ set +x; } 2>/dev/null
AFTER=$(wait_status target 0)

say "5. The proof"
echo "before checkpoint: $BEFORE"
echo "after restore:     $AFTER"
ok=1
check() {
	if [[ $2 == "$3" ]]; then printf '  %-28s %s\n' "$1" "same ($2)"; else printf '  %-28s %s\n' "$1" "DIFFERENT: $2 vs $3"; ok=0; fi
}
check "boot id" "$(field "$BEFORE" boot)" "$(field "$AFTER" boot)"
check "memory checksum" "$(field "$BEFORE" mem0)" "$(field "$AFTER" mem)"
check "disk marker (O_DIRECT read)" "$(field "$BEFORE" disk)" "$(field "$AFTER" disk)"
c1=$(field "$BEFORE" counter) c2=$(field "$AFTER" counter)
if ((c2 > c1 && c2 <= c1 + 2)); then
	printf '  %-28s %s\n' "counter" "carries on ($c1 -> $c2)"
else
	printf '  %-28s %s\n' "counter" "JUMPED ($c1 -> $c2)"; ok=0
fi
if ((ok)); then
	printf '\n\033[1;32mThe guest was checkpointed and restored without noticing.\033[0m\n'
else
	printf '\n\033[1;31mThe restored guest differs.\033[0m\n'; exit 1
fi
