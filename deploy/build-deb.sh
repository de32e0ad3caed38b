#!/usr/bin/env bash
# Builds the Debian package blebridge_<version>_<arch>.deb by hand (no debhelper), following Debian policy and
# debhelper's conventions (see deploy/README.md, "Debian package"):
#   /usr/bin/blebridge                        the release binary, stripped
#   /lib/systemd/system/blebridge.service     the unit, ExecStart pointing at /usr/bin (bookworm's unit directory)
#   /usr/lib/sysusers.d/blebridge.conf        the `blebridge` system user in group `bluetooth`
#   /etc/blebridge/config.yaml                the example configuration, a conffile
#   /usr/share/man/man1/blebridge.1.gz, /usr/share/doc/blebridge/{copyright,changelog.Debian.gz,README.md,...}
# Depends come from dpkg-shlibdeps on the binary (the library versions it was linked against), libmicrohttpd12
# (loaded with dlopen, so invisible to dpkg-shlibdeps), bluez and
# adduser. The maintainer scripts create the user and enable or start nothing on a first install.
#
# Usage: deploy/build-deb.sh [--binary PATH] [--output DIR] [--arch ARCH] [--version VERSION]
#   --binary PATH   package this already-built binary (default: build one with deploy/build-release.sh)
#   --output DIR    where the .deb goes (default: the current directory); its path is printed last
#   --arch ARCH     Debian architecture (default: dpkg --print-architecture), for a cross-built binary
#   --version V     package version (default: the version in Sources/BridgeCore/Version.swift, revision -1)
# Environment: STRIP (the strip for a cross-built binary, e.g. aarch64-linux-gnu-strip),
#   DEBFULLNAME, DEBEMAIL (the maintainer; default: git's user.name and user.email),
#   SOURCE_DATE_EPOCH (the changelog date and file times; default: the last commit's date).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"

binary=""
output="$PWD"
arch=""
version=""

die() {
    echo "build-deb.sh: $*" >&2
    exit 1
}

while [ $# -gt 0 ]; do
    case "$1" in
    --binary | --output | --arch | --version)
        [ $# -ge 2 ] || die "$1 needs a value"
        case "$1" in
        --binary) binary="$2" ;;
        --output) output="$2" ;;
        --arch) arch="$2" ;;
        --version) version="$2" ;;
        esac
        shift 2
        ;;
    -h | --help)
        awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
        exit 0
        ;;
    *) die "unknown option '$1' (try --help)" ;;
    esac
done

for tool in dpkg-deb dpkg-shlibdeps "${STRIP:-strip}" readelf gzip; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool not found (apt-get install dpkg-dev binutils)"
done

[ -n "$binary" ] || binary="$("$here/build-release.sh")"
[ -f "$binary" ] || die "binary $binary does not exist"
[ -n "$arch" ] || arch="$(dpkg --print-architecture)"
if [ -z "$version" ]; then
    upstream="$(sed -n 's/.*static let current = "\([^"]*\)".*/\1/p' "$repo/Sources/BridgeCore/Version.swift")"
    [ -n "$upstream" ] || die "could not read the version from Sources/BridgeCore/Version.swift; pass --version"
    version="$upstream-1"
fi
maintainer_name="${DEBFULLNAME:-$(git -C "$repo" config user.name 2>/dev/null || echo "blebridge maintainers")}"
maintainer_email="${DEBEMAIL:-$(git -C "$repo" config user.email 2>/dev/null || echo "root@localhost")}"
maintainer="$maintainer_name <$maintainer_email>"
if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
    SOURCE_DATE_EPOCH="$(git -C "$repo" log -1 --format=%ct 2>/dev/null || date +%s)"
fi
export SOURCE_DATE_EPOCH

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
pkg="$work/blebridge"
doc="$pkg/usr/share/doc/blebridge"

install -d "$pkg/DEBIAN" "$pkg/usr/bin" "$pkg/lib/systemd/system" "$pkg/usr/lib/sysusers.d" "$pkg/etc/blebridge" \
    "$pkg/usr/share/man/man1" "$doc/config"

install -m 0755 "$binary" "$pkg/usr/bin/blebridge"
"${STRIP:-strip}" --strip-all --remove-section=.comment --remove-section=.note "$pkg/usr/bin/blebridge"
unit="$pkg/lib/systemd/system/blebridge.service"
sed 's|/usr/local/bin/blebridge|/usr/bin/blebridge|g' "$here/blebridge.service" >"$unit"
chmod 0644 "$unit"
install -m 0644 "$here/blebridge.sysusers" "$pkg/usr/lib/sysusers.d/blebridge.conf"
install -m 0644 "$repo/config/blebridge.example.yaml" "$pkg/etc/blebridge/config.yaml"
gzip -9n <"$here/blebridge.1" >"$pkg/usr/share/man/man1/blebridge.1.gz"
install -m 0644 "$here/README.md" "$doc/README.md"
for f in README.md MQTT.md PARSERS.md ADVERTISEMENTS.md; do
    install -m 0644 "$repo/config/$f" "$doc/config/$f"
done
chmod 0644 "$pkg/usr/share/man/man1/blebridge.1.gz"

cat >"$doc/copyright" <<'EOF'
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: blebridge
Comment: The binary links the Swift standard library, the Swift concurrency runtime and FoundationEssentials
 statically; their copyright and license are listed below.

Files: *
Copyright: 2025-2026 the blebridge authors
License: unspecified
 The blebridge project has not published a license yet. Until it does, ask its maintainers before
 redistributing this package.

Files: usr/bin/blebridge (statically linked Swift runtime libraries)
Copyright: 2014-2026 Apple Inc. and the Swift project authors
License: Apache-2.0 with Runtime Library Exception
 Licensed under the Apache License, Version 2.0; on Debian systems the full text is in
 /usr/share/common-licenses/Apache-2.0.
 .
 Runtime Library Exception: as an exception, if you use this Software to compile your source code and portions
 of this Software are embedded into the binary product as a result, you may redistribute such product without
 providing attribution as would otherwise be required by Sections 4(a), 4(b) and 4(d) of the License.
EOF

changelog_date="$(date -u -R -d "@$SOURCE_DATE_EPOCH")"
cat <<EOF | gzip -9n >"$doc/changelog.Debian.gz"
blebridge ($version) unstable; urgency=medium

  * Package built from the blebridge source tree by deploy/build-deb.sh.

 -- $maintainer  $changelog_date
EOF
chmod 0644 "$doc/copyright" "$doc/changelog.Debian.gz"

# Depends: dpkg-shlibdeps reads the binary's NEEDED libraries and the symbols files of the packages that
# provide them, giving the lowest version that has every symbol the binary uses.
mkdir -p "$work/src/debian"
cat >"$work/src/debian/control" <<EOF
Source: blebridge

Package: blebridge
Architecture: any
EOF
shlibs="$(cd "$work/src" && dpkg-shlibdeps -O -e"$pkg/usr/bin/blebridge" 2>"$work/shlibdeps.err")" || {
    cat "$work/shlibdeps.err" >&2
    die "dpkg-shlibdeps failed"
}
shlibs="${shlibs#shlibs:Depends=}"
[ -n "$shlibs" ] || die "dpkg-shlibdeps found no library dependencies"
# A library whose shlibs file carries no version (libyaml-0-2) gets the upstream version it was built against.
deps=()
IFS=',' read -ra entries <<<"$shlibs"
for entry in "${entries[@]}"; do
    entry="$(echo "$entry" | sed 's/^ *//; s/ *$//')"
    name="${entry%% *}"
    if [ "$entry" = "$name" ]; then
        query="$name"
        [ "$arch" != "$(dpkg --print-architecture)" ] && query="$name:$arch"
        built="$(dpkg-query -W -f='${Version}' "$query" 2>/dev/null || true)"
        if [ -n "$built" ]; then
            built="${built#*:}"
            entry="$name (>= ${built%-*})"
        fi
    fi
    deps+=("$entry")
done
for needed in libdbus-1-3 libmosquitto1 libyaml-0-2 libssl3; do
    printf '%s\n' "${deps[@]}" | grep -q "^$needed " ||
        die "dpkg-shlibdeps did not report $needed with a version (got: $shlibs)"
done
# The binary's relocations are packed (DT_RELR, deploy/build-release.sh), which glibc reads since 2.36. The binary
# asks for that through a version of its own (GLIBC_ABI_DT_RELR) that no symbol carries, and dpkg-shlibdeps weighs
# only the symbols a binary uses: it says 2.35.
if readelf -V "$pkg/usr/bin/blebridge" | grep -q GLIBC_ABI_DT_RELR; then
    for i in "${!deps[@]}"; do
        case "${deps[$i]}" in
        "libc6 (>= "*)
            libc_version="${deps[$i]#libc6 (>= }"
            dpkg --compare-versions "${libc_version%)}" ge 2.36 || deps[i]="libc6 (>= 2.36)"
            ;;
        esac
    done
fi
# libmicrohttpd (the metrics endpoint) is loaded with dlopen(3) when a server starts (Sources/CMicroHTTPD/shim.h),
# so the binary does not list it and dpkg-shlibdeps cannot see it. 0.9.50 is what dpkg-shlibdeps gave for the same
# seven functions when the binary was linked against it.
printf '%s\n' "${deps[@]}" | grep -q '^libmicrohttpd12 ' && die "libmicrohttpd12 is linked again; drop the entry below"
deps+=("libmicrohttpd12 (>= 0.9.50)")
mapfile -t deps < <(printf '%s\n' "${deps[@]}" | LC_ALL=C sort)
depends="$(printf '%s, ' "${deps[@]}")bluez, adduser"

installed_size="$(du -sk --exclude=DEBIAN "$pkg" | cut -f1)"
cat >"$pkg/DEBIAN/control" <<EOF
Package: blebridge
Version: $version
Architecture: $arch
Maintainer: $maintainer
Installed-Size: $installed_size
Depends: $depends
Section: net
Priority: optional
Description: bridge from Bluetooth Low Energy sensors to MQTT
 blebridge talks to BlueZ (bluetoothd) over the D-Bus system bus, decodes the
 values of the configured sensors (standard GATT characteristics, BTHome,
 RuuviTag, Xiaomi and other advertisements, declared vendor formats) and
 publishes them as JSON to an MQTT broker, with availability, Home Assistant
 discovery and commands that become GATT writes and reads.
 .
 The package installs a hardened systemd unit (blebridge.service) that runs
 as the system user blebridge in the bluetooth group. It is neither enabled
 nor started on installation: edit /etc/blebridge/config.yaml, then run
 "systemctl enable --now blebridge".
EOF
echo /etc/blebridge/config.yaml >"$pkg/DEBIAN/conffiles"

cat >"$pkg/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e

if [ "$1" = "configure" ]; then
    # The user, from the sysusers file when systemd-sysusers exists, else with adduser.
    if command -v systemd-sysusers >/dev/null 2>&1; then
        systemd-sysusers blebridge.conf
    else
        getent group bluetooth >/dev/null || addgroup --quiet --system bluetooth
        getent passwd blebridge >/dev/null ||
            adduser --quiet --system --group --home /var/lib/blebridge --no-create-home \
                --gecos "blebridge BLE-to-MQTT bridge" blebridge
        adduser --quiet blebridge bluetooth
    fi
    # The configuration may name broker credentials: readable by the service's group, not by everyone.
    if [ -f /etc/blebridge/config.yaml ] && ! dpkg-statoverride --list /etc/blebridge/config.yaml >/dev/null; then
        chgrp blebridge /etc/blebridge/config.yaml
        chmod 0640 /etc/blebridge/config.yaml
    fi
fi

# As dh_installsystemd --no-enable --no-start: keep an existing enablement, enable nothing on a first install.
case "$1" in configure | abort-upgrade | abort-deconfigure | abort-remove)
    if command -v deb-systemd-helper >/dev/null; then
        if deb-systemd-helper debian-installed 'blebridge.service'; then
            deb-systemd-helper unmask 'blebridge.service' >/dev/null || true
            if deb-systemd-helper --quiet was-enabled 'blebridge.service'; then
                deb-systemd-helper enable 'blebridge.service' >/dev/null || true
            fi
        fi
        deb-systemd-helper update-state 'blebridge.service' >/dev/null || true
    fi
    if [ -d /run/systemd/system ]; then
        systemctl --system daemon-reload >/dev/null || true
        # An upgrade restarts a running bridge on the new binary; a first install starts nothing.
        if [ -n "$2" ] && command -v deb-systemd-invoke >/dev/null; then
            deb-systemd-invoke try-restart 'blebridge.service' >/dev/null || true
        fi
    fi
    ;;
esac

if [ "$1" = "configure" ] && [ -z "$2" ]; then
    echo "blebridge: edit /etc/blebridge/config.yaml and check it with"
    echo "blebridge:   blebridge check-config /etc/blebridge/config.yaml"
    echo "blebridge: then start the bridge with 'systemctl enable --now blebridge'."
fi
exit 0
EOF

cat >"$pkg/DEBIAN/prerm" <<'EOF'
#!/bin/sh
set -e
if [ -d /run/systemd/system ] && [ "$1" = remove ] && command -v deb-systemd-invoke >/dev/null; then
    deb-systemd-invoke stop 'blebridge.service' >/dev/null || true
fi
exit 0
EOF

cat >"$pkg/DEBIAN/postrm" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = "remove" ] && command -v deb-systemd-helper >/dev/null; then
    deb-systemd-helper mask 'blebridge.service' >/dev/null || true
fi
if [ "$1" = "purge" ]; then
    if command -v deb-systemd-helper >/dev/null; then
        deb-systemd-helper purge 'blebridge.service' >/dev/null || true
        deb-systemd-helper unmask 'blebridge.service' >/dev/null || true
    fi
    # The state directory goes with a purge; the system user stays (Debian policy 9.2.2: its uid may own files).
    rm -rf /var/lib/blebridge /var/lib/private/blebridge
fi
if [ -d /run/systemd/system ]; then
    systemctl --system daemon-reload >/dev/null || true
fi
exit 0
EOF
chmod 0755 "$pkg/DEBIAN/postinst" "$pkg/DEBIAN/prerm" "$pkg/DEBIAN/postrm"

# md5sums of every file but the conffiles (dpkg records those itself), as dh_md5sums does.
(cd "$pkg" && find . -type f ! -path './DEBIAN/*' ! -path './etc/*' -printf '%P\0' | LC_ALL=C sort -z |
    xargs -0 md5sum) >"$pkg/DEBIAN/md5sums"
chmod 0644 "$pkg/DEBIAN/control" "$pkg/DEBIAN/conffiles" "$pkg/DEBIAN/md5sums"

find "$pkg" -type d -exec chmod 0755 {} +
find "$pkg" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +

mkdir -p "$output"
deb="$(cd "$output" && pwd)/blebridge_${version}_${arch}.deb"
dpkg-deb --build --root-owner-group -Zxz "$pkg" "$deb" >&2
echo "$deb"
