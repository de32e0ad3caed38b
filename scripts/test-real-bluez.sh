#!/usr/bin/env bash
# Runs blebridge's end-to-end checks against the REAL bluetoothd of Debian 12 (BlueZ 5.66) in a small VM: two
# virtual LE controllers on one emulated link (btvirt), a Bumble GATT peripheral on one of them, bluetoothd on the
# other, our static binary shared in over 9p. See docs/REAL-BLUEZ.md.
#
# usage: scripts/test-real-bluez.sh [--loops N] [--out DIR] [--binary PATH]
#   --loops N      iterations of the explore-then-read loop (default 10)
#   --out DIR      output directory (default .build/real-bluez/<UTC time>): results.txt, console.log, bluetoothd.log,
#                  dbus-monitor.log, hci.btsnoop, peer.log, checks/, failures/
#   --binary PATH  the blebridge binary to test (default: built with deploy/build-release.sh)
# Environment: REAL_BLUEZ_CACHE (image cache, default /var/cache/blebridge-real-bluez), REAL_BLUEZ_MIRROR,
# REAL_BLUEZ_VM_TIMEOUT (seconds; default 720 + 125 per loop iteration).
# Exit status: 0 when every check passed; 1 when a check failed or did not run; 2 when the VM could not run.
# Needs root (debootstrap, once per image) and qemu-system-x86; no KVM (TCG only). Nothing in the VM has a network
# interface other than loopback.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
loops=10 out="" binary=""
while [ $# -gt 0 ]; do
    case "$1" in
        --loops) loops="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --binary) binary="$2"; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "test-real-bluez: unknown argument '$1'" >&2; exit 2 ;;
    esac
done
die() { echo "test-real-bluez: CANNOT RUN: $*" >&2; exit 2; }
cache="${REAL_BLUEZ_CACHE:-/var/cache/blebridge-real-bluez}"
out="${out:-$repo/.build/real-bluez/$(date -u +%Y%m%dT%H%M%SZ)}"

[ "$(id -u)" = 0 ] || die "needs root (debootstrap builds the image; 9p shares run as root)"
for tool in qemu-system-x86_64 debootstrap cpio apt-get dpkg-deb; do
    command -v "$tool" >/dev/null || die "$tool not found: run scripts/install-deps.sh"
done
[[ "$loops" =~ ^[0-9]+$ ]] || die "--loops '$loops' is not a number"
# The VM gets 2 GiB (the root file system lives in its RAM) and QEMU needs some on top.
avail_kb=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
[ "${avail_kb:-0}" -ge 2800000 ] || die "needs about 2.8 GB of free memory for the VM, $((${avail_kb:-0} / 1024)) MB available"

t_start=$(date +%s)
if [ -z "$binary" ]; then
    echo "test-real-bluez: building the release binary (deploy/build-release.sh)" >&2
    binary="$("$repo/deploy/build-release.sh")" || die "deploy/build-release.sh failed"
fi
[ -x "$binary" ] || die "binary '$binary' is not executable"

mkdir -p "$cache"
t_image=$(date +%s)
img="$("$repo/Tests/realbluez/build-image.sh" "$cache")" || die "building the VM image failed (see above)"
t_image=$(( $(date +%s) - t_image ))

mkdir -p "$out"
out="$(cd "$out" && pwd)"
rig="$out/.rig"
rm -rf "$rig"; mkdir -p "$rig/realbluez"
cp "$binary" "$rig/blebridge"
cp "$repo"/Tests/realbluez/{vm-checks.sh,peer.py,central.py,user_channel.py} "$rig/realbluez/"
echo "$loops" > "$rig/loops"
cp "$img/manifest" "$out/image-manifest.txt"
rm -f "$out/status" "$out/results.txt"

# The initramfs the kernel unpacks: the cached image, then a second archive holding only Tests/realbluez/init (a later
# archive's file replaces an earlier one's), so the init changes without an image rebuild.
initrd="$cache/run-$$.cpio"
stage="$(mktemp -d)"
install -m 0755 "$repo/Tests/realbluez/init" "$stage/init"
cat "$img/rootfs.cpio" > "$initrd"
(cd "$stage" && echo init | cpio -o -H newc --quiet) >> "$initrd"
rm -rf "$stage"
trap 'rm -f "$initrd"' EXIT
echo "test-real-bluez: booting the VM (TCG, image $(basename "$img")); output in $out" >&2
t_boot=$(date +%s)
set +e
# The limit: boot and the single checks take a few minutes; an iteration at most 2 x 60 s (the runner's own limits).
vm_timeout="${REAL_BLUEZ_VM_TIMEOUT:-$((720 + loops * 125))}"
timeout "$vm_timeout" qemu-system-x86_64 \
    -accel tcg,thread=multi -cpu max -smp 2 -m 2048 \
    -nographic -no-reboot -nic none -monitor none -serial stdio \
    -kernel "$img/vmlinuz" -initrd "$initrd" \
    -append "console=ttyS0 rdinit=/init panic=-1 quiet loglevel=4" \
    -virtfs "local,path=$rig,mount_tag=rig,security_model=none,readonly=on" \
    -virtfs "local,path=$out,mount_tag=out,security_model=none" \
    < /dev/null 2>&1 | tee "$out/console.log"
qemu_status=${PIPESTATUS[0]}
set -e
t_vm=$(( $(date +%s) - t_boot ))
rm -rf "$rig"

echo
echo "test-real-bluez: image $t_image s (cached when ~0), VM run $t_vm s, total $(( $(date +%s) - t_start )) s" |
    tee "$out/timings.txt"
[ -f "$out/timeline.txt" ] && cat "$out/timeline.txt" >> "$out/timings.txt"
if [ "$qemu_status" = 124 ]; then die "the VM did not finish within $vm_timeout s (console: $out/console.log)"; fi
grep -q '^SUMMARY' "$out/results.txt" 2>/dev/null || die "the VM ended (qemu status $qemu_status) without finishing the checks (console: $out/console.log)"
echo "test-real-bluez: results ($out/results.txt):"
cat "$out/results.txt"
[ "$(cat "$out/status" 2>/dev/null)" = 0 ] || exit 1
