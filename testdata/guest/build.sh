#!/bin/sh
# build.sh [--kernel cloud|generic] OUTDIR — build the vmsnap test guest:
# OUTDIR/vmlinuz and OUTDIR/initrd.
#
# Kernel, by flavour, fetched with `apt-get download` (never installed) and
# unpacked with `dpkg-deb -x`:
#   cloud (default)  the versioned package behind Debian's
#                    linux-image-cloud-amd64 metapackage (boots fastest; has
#                    no VM generation ID driver: # CONFIG_VIRT_DRIVERS is not set)
#   generic          Debian's generic kernel, pinned below by version and
#                    SHA256 (CONFIG_VMGENID=y: the guest reseeds its RNG when
#                    QEMU's vmgenid device gives it a new generation ID)
# Initramfs: busybox-static + the virtio modules + ./init, packed as a gzip'd
# cpio (newc).
#
# Idempotent and cache-friendly: OUTDIR/stamp holds a hash of this script and
# of ./init; when it matches and both outputs exist nothing is done (and
# neither apt nor the network is touched). Outputs are built in a temporary
# directory and renamed into place, the stamp last.
#
# Environment:
#   VMSNAP_KERNEL_DEB        a kernel .deb to use instead of downloading one
#                            (for generic: it must match the pinned SHA256);
#                            or a directory to use as the download cache
#                            (default OUTDIR/debs)
#   VMSNAP_BUSYBOX           the static busybox binary (default /bin/busybox)
#
# Exit status: 0 ok; 3 a prerequisite is missing (message on stderr, starting
# with "build.sh: MISSING:"); anything else is a build failure.
set -eu

die() { echo "build.sh: ERROR: $*" >&2; exit 1; }
missing() { echo "build.sh: MISSING: $*" >&2; exit 3; }
log() { echo "build.sh: $*" >&2; }

FLAVOUR=cloud
if [ "${1:-}" = --kernel ]; then
	FLAVOUR=${2:-}
	shift 2 || true
fi
case $FLAVOUR in cloud | generic) ;; *) echo "usage: $0 [--kernel cloud|generic] OUTDIR" >&2; exit 2 ;; esac
[ $# -eq 1 ] || { echo "usage: $0 [--kernel cloud|generic] OUTDIR" >&2; exit 2; }
OUTDIR=$1

# The generic kernel, pinned: version and SHA256 from Debian's package index
# (apt-cache show linux-image-6.1.0-57-amd64). Update all three together.
GENERIC_PKG=linux-image-6.1.0-57-amd64
GENERIC_VERSION=6.1.192-3
GENERIC_SHA256=14d219d01e1283261817d961dbb3895cb5b4288d0de10e0ba0632a0d993e15bf
SRCDIR=$(cd "$(dirname "$0")" && pwd)
INIT=$SRCDIR/init
[ -f "$INIT" ] || die "init script not found at $INIT"

mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)

# Hash of the inputs. The kernel package is resolved afresh only on rebuilds.
command -v sha256sum >/dev/null 2>&1 || missing "sha256sum (coreutils) not found"
HASH=$( (cat "$SRCDIR/build.sh" "$INIT"; echo "flavour=$FLAVOUR") | sha256sum | cut -d' ' -f1)

uptodate() {
	[ -f "$OUTDIR/stamp" ] && [ -f "$OUTDIR/vmlinuz" ] && [ -f "$OUTDIR/initrd" ] &&
		[ "$(head -n1 "$OUTDIR/stamp")" = "$HASH" ]
}
if uptodate; then
	exit 0
fi

# Serialise concurrent builds into the same OUTDIR (when flock(1) exists).
if command -v flock >/dev/null 2>&1 && [ -z "${VMSNAP_BUILD_LOCKED:-}" ]; then
	export VMSNAP_BUILD_LOCKED=1
	exec flock "$OUTDIR/.build.lock" sh "$0" --kernel "$FLAVOUR" "$@"
fi
if uptodate; then
	exit 0
fi

# --- prerequisites ---------------------------------------------------------
BUSYBOX=${VMSNAP_BUSYBOX:-/bin/busybox}
[ -x "$BUSYBOX" ] || missing "busybox-static not installed: $BUSYBOX not found (apt-get install busybox-static)"
if command -v readelf >/dev/null 2>&1; then
	if readelf -l "$BUSYBOX" 2>/dev/null | grep -q 'program interpreter'; then
		missing "$BUSYBOX is dynamically linked; the guest needs a static one (apt-get install busybox-static)"
	fi
elif command -v file >/dev/null 2>&1; then
	case $(file -L "$BUSYBOX") in
	*dynamically\ linked*) missing "$BUSYBOX is dynamically linked; the guest needs a static one (apt-get install busybox-static)" ;;
	esac
fi
command -v cpio >/dev/null 2>&1 || missing "cpio not installed (apt-get install cpio)"
command -v gzip >/dev/null 2>&1 || missing "gzip not installed (apt-get install gzip)"
command -v dpkg-deb >/dev/null 2>&1 || missing "dpkg-deb not found (needs a Debian-based host)"

TMP=$(mktemp -d "$OUTDIR/.tmp.XXXXXX")
trap 'rm -rf "$TMP"' EXIT INT TERM

# --- kernel package --------------------------------------------------------
# download PKG SPEC: the cached PKG_*.deb, else `apt-get download SPEC` into
# the cache; prints its path.
download() {
	f=$(ls "$DEBCACHE/${1}"_*.deb 2>/dev/null | sort | tail -n1 || true)
	if [ -n "$f" ]; then
		echo "$f"
		return
	fi
	command -v apt-get >/dev/null 2>&1 || missing "apt-get not found: cannot download $2 (set VMSNAP_KERNEL_DEB)"
	mkdir -p "$DEBCACHE"
	DL=$(mktemp -d "$DEBCACHE/.dl.XXXXXX")
	chmod 0777 "$DL" # so apt's _apt sandbox user may write there when run as root
	log "downloading $2 with apt-get download"
	if ! (cd "$DL" && apt-get download "$2" >"$DL/apt.log" 2>&1); then
		cat "$DL/apt.log" >&2
		rm -rf "$DL"
		missing "apt-get download $2 failed (no network/apt mirror? run apt-get update, or set VMSNAP_KERNEL_DEB to a downloaded .deb)"
	fi
	f=$(ls "$DL/${1}"_*.deb 2>/dev/null | head -n1 || true)
	[ -n "$f" ] || { cat "$DL/apt.log" >&2; rm -rf "$DL"; die "apt-get download $2 produced no .deb"; }
	mv "$f" "$DEBCACHE/"
	rm -rf "$DL"
	echo "$DEBCACHE/$(basename "$f")"
}

DEBCACHE=$OUTDIR/debs
DEB=
if [ -n "${VMSNAP_KERNEL_DEB:-}" ]; then
	if [ -d "$VMSNAP_KERNEL_DEB" ]; then
		DEBCACHE=$VMSNAP_KERNEL_DEB
	elif [ -f "$VMSNAP_KERNEL_DEB" ]; then
		DEB=$VMSNAP_KERNEL_DEB
	else
		die "VMSNAP_KERNEL_DEB=$VMSNAP_KERNEL_DEB is neither a .deb file nor a directory"
	fi
fi

if [ "$FLAVOUR" = generic ]; then
	[ -n "$DEB" ] || DEB=$(download "$GENERIC_PKG" "$GENERIC_PKG=$GENERIC_VERSION")
	SUM=$(sha256sum "$DEB" | cut -d' ' -f1)
	[ "$SUM" = "$GENERIC_SHA256" ] ||
		die "$DEB has SHA256 $SUM, but $GENERIC_PKG $GENERIC_VERSION is pinned at $GENERIC_SHA256 (update the pins in build.sh together)"
elif [ -z "$DEB" ]; then
	command -v apt-cache >/dev/null 2>&1 || missing "apt-cache not found: cannot resolve linux-image-cloud-amd64 (set VMSNAP_KERNEL_DEB to a linux-image-*-cloud-amd64 .deb)"
	PKG=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null |
		sed -n 's/^ *Depends: *\(linux-image-[0-9][^ ]*-cloud-amd64\)$/\1/p' | head -n1)
	if [ -z "$PKG" ]; then
		# No package lists? Fall back to any previously downloaded kernel.
		DEB=$(ls "$DEBCACHE"/linux-image-[0-9]*-cloud-amd64_*.deb 2>/dev/null | sort | tail -n1 || true)
		[ -n "$DEB" ] || missing "cannot resolve linux-image-cloud-amd64 with apt-cache depends (run apt-get update, or set VMSNAP_KERNEL_DEB to a linux-image-*-cloud-amd64 .deb)"
		log "apt-cache could not resolve linux-image-cloud-amd64; using cached $DEB"
	else
		DEB=$(download "$PKG" "$PKG")
	fi
fi
log "kernel package: $DEB"

X=$TMP/deb
mkdir -p "$X"
dpkg-deb -x "$DEB" "$X" || die "dpkg-deb -x $DEB failed"
VMLINUZ=$(ls "$X"/boot/vmlinuz-* 2>/dev/null | head -n1 || true)
[ -n "$VMLINUZ" ] || die "no boot/vmlinuz-* in $DEB"
KVER=${VMLINUZ##*/vmlinuz-}
MODDIR=
for d in "$X/lib/modules/$KVER" "$X/usr/lib/modules/$KVER"; do
	[ -d "$d" ] && MODDIR=$d && break
done
[ -n "$MODDIR" ] || die "no modules directory for $KVER in $DEB"
if [ "$FLAVOUR" = generic ]; then
	grep -qx CONFIG_VMGENID=y "$X/boot/config-$KVER" 2>/dev/null ||
		die "$DEB: kernel $KVER is not built with CONFIG_VMGENID=y (see boot/config-$KVER)"
fi

# --- initramfs tree --------------------------------------------------------
R=$TMP/root
mkdir -p "$R/bin" "$R/sbin" "$R/usr/bin" "$R/usr/sbin" "$R/dev" "$R/proc" \
	"$R/sys" "$R/tmp" "$R/mem" "$R/run" "$R/lib/modules" "$R/etc"
cp "$BUSYBOX" "$R/bin/busybox"
chmod 0755 "$R/bin/busybox"
for applet in $("$BUSYBOX" --list-full); do
	case $applet in
	bin/busybox) continue ;;
	esac
	[ -e "$R/$applet" ] || ln -s /bin/busybox "$R/$applet"
done
[ -e "$R/bin/sh" ] || die "busybox has no sh applet"
cp "$INIT" "$R/init"
chmod 0755 "$R/init"

# Modules, in load order (the order is also hard-coded in init). A module
# built into this kernel (modules.builtin) is simply not shipped.
for m in virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk; do
	f=$(find "$MODDIR/kernel" \( -name "$m.ko" -o -name "$m.ko.*" \) 2>/dev/null | head -n1)
	if [ -z "$f" ]; then
		if grep -q "/$m\.ko\$" "$MODDIR/modules.builtin" 2>/dev/null; then
			log "module $m is built into $KVER"
			continue
		fi
		die "module $m not found in $DEB"
	fi
	case $f in
	*.ko) cp "$f" "$R/lib/modules/$m.ko" ;;
	*.ko.xz) command -v xz >/dev/null 2>&1 || missing "xz not installed (needed for $f)"
		xz -dc "$f" >"$R/lib/modules/$m.ko" ;;
	*.ko.zst) command -v zstd >/dev/null 2>&1 || missing "zstd not installed (needed for $f)"
		zstd -qdc "$f" >"$R/lib/modules/$m.ko" ;;
	*.ko.gz) gzip -dc "$f" >"$R/lib/modules/$m.ko" ;;
	*) die "unknown module compression: $f" ;;
	esac
done
echo "$KVER" >"$R/etc/kernel-release"

# Deterministic-ish archive: sorted names, root-owned.
(cd "$R" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) |
	gzip -9n >"$TMP/initrd" || die "packing the initramfs failed"
cp "$VMLINUZ" "$TMP/vmlinuz"

# --- install ---------------------------------------------------------------
printf '%s\nflavour=%s\nkernel=%s\ndeb=%s\n' "$HASH" "$FLAVOUR" "$KVER" "$(basename "$DEB")" >"$TMP/stamp"
rm -f "$OUTDIR/stamp"
mv -f "$TMP/vmlinuz" "$OUTDIR/vmlinuz"
mv -f "$TMP/initrd" "$OUTDIR/initrd"
mv -f "$TMP/stamp" "$OUTDIR/stamp"
log "built $OUTDIR/vmlinuz and $OUTDIR/initrd (kernel $KVER)"
