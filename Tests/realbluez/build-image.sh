#!/usr/bin/env bash
# Builds the real-BlueZ VM image: Debian 12's kernel (extracted from its package, not installed), a debootstrap root
# filesystem with the distribution's bluetoothd, btvirt, dbus, mosquitto and Python with Bumble (from PyPI), packed as
# one uncompressed initramfs that the kernel unpacks into RAM (no disk, no boot loader, no initramfs tool).
# Usage: build-image.sh <cache-dir>   Prints the image directory (holding vmlinuz, rootfs.cpio, manifest) on stdout.
# The image directory is named after a hash of the package list, the peer's Python packages, the kernel package and
# FORMAT, so a change to any of them builds a new image and an unchanged list reuses the cached one.
# Only the package fetches retry (network); every other failure stops the build with the step that failed.
set -euo pipefail
cache="${1:?usage: build-image.sh <cache-dir>}"
MIRROR="${REAL_BLUEZ_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
DEBS=(bluez bluez-test-tools dbus dbus-bin mosquitto mosquitto-clients python3 python3-venv kmod procps iproute2
      libdbus-1-3 libmosquitto1 libyaml-0-2 libssl3 libmicrohttpd12 libstdc++6)   # the last six: what blebridge loads
PIP=(bumble==0.0.236)

log() { echo "build-image: $*" >&2; }
retry() {   # retry <what> <command...>: for network fetches only
    local what="$1"; shift
    for attempt in 1 2 3; do
        "$@" && return 0
        log "$what failed (attempt $attempt of 3)"; sleep $((attempt * 5))
    done
    log "$what failed 3 times: giving up"; return 1
}

kernel_package() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-6/ {print $2; exit}'; }
kernel_pkg="$(kernel_package)"
if [ -z "$kernel_pkg" ] && [ "$(id -u)" = 0 ]; then   # a fresh machine's package lists may be empty
    retry "apt-get update" apt-get update -qq && kernel_pkg="$(kernel_package)"
fi
[ -n "$kernel_pkg" ] || { log "cannot resolve Debian's linux-image-amd64 to a 6.1 kernel package (apt-get update?)"; exit 1; }
# FORMAT: bump it when this script changes what goes into the image (anything beyond the lists below).
FORMAT=1
key="$(echo "format $FORMAT $SUITE ${DEBS[*]} ${PIP[*]} $kernel_pkg" | sha256sum | cut -c1-16)"
img="$cache/image-$key"
if [ -f "$img/manifest" ] && [ -f "$img/rootfs.cpio" ] && [ -f "$img/vmlinuz" ]; then
    log "reusing cached image $img"; echo "$img"; exit 0
fi
for tool in debootstrap cpio chroot; do
    command -v "$tool" >/dev/null || { log "$tool not found (run scripts/install-deps.sh)"; exit 1; }
done
[ "$(id -u)" = 0 ] || { log "debootstrap needs root"; exit 1; }

start=$(date +%s)
work="$cache/build-$key.$$"
rm -rf "$work"; mkdir -p "$work"
cleanup() {
    for m in proc sys dev; do umount "$work/root/$m" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT
root="$work/root"

log "debootstrap $SUITE from $MIRROR (${#DEBS[@]} packages)"
inc="$(IFS=,; echo "${DEBS[*]}")"
retry debootstrap bash -c "rm -rf '$root' && debootstrap --variant=minbase --include='$inc' $SUITE '$root' '$MIRROR' >'$work/debootstrap.log' 2>&1" ||
    { tail -20 "$work/debootstrap.log" >&2; exit 1; }

log "kernel: $kernel_pkg (extracted, not installed)"
(cd "$work" && retry "apt-get download $kernel_pkg" apt-get download -q "$kernel_pkg" >/dev/null)
dpkg-deb -x "$work"/"$kernel_pkg"_*.deb "$work/kernel"
kver="$(ls "$work/kernel/lib/modules")"
mkdir -p "$root/lib/modules"
cp -a "$work/kernel/lib/modules/$kver" "$root/lib/modules/"
depmod -b "$root" "$kver"

# The wheels come through the host's pip (with the host's index and certificate settings: the chroot has neither),
# binary only, for the host's Python 3.11 on glibc 2.36, which the image shares; the image installs them offline.
log "Bumble from PyPI into /opt/bumble: ${PIP[*]}"
retry "pip download ${PIP[*]}" "${HOST_PYTHON:-python3}" -m pip download -q --only-binary=:all: -d "$work/wheels" "${PIP[@]}"
mkdir -p "$root/tmp/wheels"; cp "$work"/wheels/*.whl "$root/tmp/wheels/"
mount -t proc proc "$root/proc"; mount --bind /dev "$root/dev"; mount -t sysfs sys "$root/sys"
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root chroot "$root" python3 -m venv /opt/bumble
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root chroot "$root" /opt/bumble/bin/pip install -q --no-index \
    --find-links /tmp/wheels "${PIP[@]}"
umount "$root/proc" "$root/dev" "$root/sys"
rm -rf "$root/tmp/wheels"
chroot "$root" /opt/bumble/bin/python -c 'import bumble; print("bumble", bumble.__version__ if hasattr(bumble, "__version__") else "?")' >&2 || true

log "trimming and packing"
rm -rf "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/var/cache/apt/archives/*.deb \
       "$root"/var/lib/apt/lists/* "$root/lib/modules/$kver"/kernel/drivers/{gpu,net/wireless,media,infiniband,staging,scsi,isdn} \
       "$root/lib/modules/$kver"/kernel/sound
depmod -b "$root" "$kver"
echo "blebridge-real-bluez" > "$root/etc/hostname"
printf 'nameserver 127.0.0.1\n' > "$root/etc/resolv.conf"   # loopback only: nothing in the VM resolves outside names
# No /init here: scripts/test-real-bluez.sh appends Tests/realbluez/init as a second cpio archive at boot, so the
# init can change without a rebuild.
mkdir -p "$root/mnt/share"
(cd "$root" && find . -xdev | cpio -o -H newc --quiet) > "$work/rootfs.cpio"
cp "$work/kernel/boot/vmlinuz-$kver" "$work/vmlinuz"

mkdir -p "$img.tmp"
mv "$work/rootfs.cpio" "$work/vmlinuz" "$img.tmp/"
{
    echo "kernel $kernel_pkg $kver"
    echo "suite $SUITE mirror $MIRROR"
    chroot "$root" dpkg-query -W -f='${Package} ${Version}\n' bluez bluez-test-tools dbus mosquitto python3
    chroot "$root" /opt/bumble/bin/pip list --format=freeze 2>/dev/null | grep -i '^bumble=='
    echo "built in $(( $(date +%s) - start )) s"
} > "$img.tmp/manifest"
rm -rf "$img"; mv "$img.tmp" "$img"
log "image $img built in $(( $(date +%s) - start )) s"
echo "$img"
