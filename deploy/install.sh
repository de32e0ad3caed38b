#!/usr/bin/env bash
# Installs blebridge as a systemd service on this machine (see deploy/README.md):
#   /usr/local/bin/blebridge                  release build, Swift standard library linked statically, stripped
#   /etc/systemd/system/blebridge.service     the unit (deploy/blebridge.service)
#   /etc/sysusers.d/blebridge.conf            the `blebridge` system user, member of `bluetooth`
#   /usr/local/share/man/man1/blebridge.1     the man page
#   /etc/blebridge/config.yaml                config/blebridge.example.yaml, only when there is none yet
#
# Usage: deploy/install.sh [--binary PATH] [--root DIR] [--no-reload]
#        deploy/install.sh --uninstall [--root DIR]
#   --binary PATH  install this already-built binary instead of building one (it is stripped on the way)
#   --root DIR     install into DIR instead of / (a scratch tree for tests or an image); systemd is not touched
#   --no-reload    do not run `systemctl daemon-reload`
#   --uninstall    remove the binary, the unit, the sysusers file and the user; keep the configuration and state
#
# Idempotent: a second run changes nothing (files are replaced only when their content differs, the user only
# created when missing). Needs root for /; with --root only write access to DIR.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"

root=""
binary=""
uninstall=0
reload=1

die() {
    echo "install.sh: $*" >&2
    exit 1
}
say() { echo "install.sh: $*"; }

while [ $# -gt 0 ]; do
    case "$1" in
    --root)
        [ $# -ge 2 ] || die "--root needs a directory"
        root="$2"
        shift 2
        ;;
    --binary)
        [ $# -ge 2 ] || die "--binary needs a path"
        binary="$2"
        shift 2
        ;;
    --uninstall) uninstall=1; shift ;;
    --no-reload) reload=0; shift ;;
    -h | --help)
        awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
        exit 0
        ;;
    *) die "unknown option '$1' (try --help)" ;;
    esac
done

if [ -n "$root" ]; then
    mkdir -p "$root"
    root="$(cd "$root" && pwd)"
    [ "$root" = / ] && root=""
fi
if [ -z "$root" ] && [ "$(id -u)" != 0 ]; then
    die "installing into / needs root: run it with sudo (or use --root DIR)"
fi

bin_path="$root/usr/local/bin/blebridge"
unit_path="$root/etc/systemd/system/blebridge.service"
sysusers_path="$root/etc/sysusers.d/blebridge.conf"
man_path="$root/usr/local/share/man/man1/blebridge.1"
config_dir="$root/etc/blebridge"
config_path="$config_dir/config.yaml"

# systemd is ours to talk to only when installing into / on a machine booted with systemd.
systemd_running() { [ -z "$root" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; }

# Copies SRC to DEST with MODE unless DEST already has the same content and mode; prints what it did.
put() {
    local src="$1" dest="$2" mode="$3"
    if [ -f "$dest" ] && cmp -s "$src" "$dest" && [ "$(stat -c %a "$dest")" = "${mode#0}" ]; then
        say "unchanged $dest"
        return 0
    fi
    mkdir -p "$(dirname "$dest")"
    # A temporary file next to the target and a rename: a running binary is replaced, never overwritten.
    local tmp
    tmp="$(mktemp "$(dirname "$dest")/.blebridge.XXXXXX")"
    cp "$src" "$tmp"
    chmod "$mode" "$tmp"
    mv -f "$tmp" "$dest"
    say "installed $dest"
}

remove() {
    if [ -e "$1" ] || [ -L "$1" ]; then
        rm -f "$1"
        say "removed $1"
    fi
}

# The user database of the target root. Looks only at the files, so it works on a scratch tree too.
has_user() { [ -f "$root/etc/passwd" ] && grep -q "^$1:" "$root/etc/passwd"; }
has_group() { [ -f "$root/etc/group" ] && grep -q "^$1:" "$root/etc/group"; }
in_group() { [ -f "$root/etc/group" ] && grep -Eq "^$2:[^:]*:[^:]*:(.*,)?$1(,|\$)" "$root/etc/group"; }

create_user() {
    if has_user blebridge && in_group blebridge bluetooth; then
        say "user blebridge (group bluetooth) already present"
        return 0
    fi
    if command -v systemd-sysusers >/dev/null 2>&1; then
        if [ -n "$root" ]; then
            systemd-sysusers --root "$root" "$sysusers_path"
        else
            systemd-sysusers "$sysusers_path"
        fi
    else
        # No systemd-sysusers (a container, an old release): shadow's tools, on the target root with --prefix.
        local prefix=()
        [ -n "$root" ] && prefix=(--prefix "$root")
        has_group bluetooth || groupadd "${prefix[@]}" --system bluetooth
        if has_user blebridge; then
            usermod "${prefix[@]}" --append --groups bluetooth blebridge
        else
            useradd "${prefix[@]}" --system --user-group --groups bluetooth --home-dir /var/lib/blebridge \
                --no-create-home --shell /usr/sbin/nologin --comment "blebridge BLE-to-MQTT bridge" blebridge
        fi
    fi
    has_user blebridge && in_group blebridge bluetooth || die "could not create the user blebridge in group bluetooth"
    say "created user blebridge (group bluetooth)"
}

remove_user() {
    if ! has_user blebridge; then
        return 0
    fi
    if [ -n "$root" ]; then
        userdel --prefix "$root" blebridge 2>/dev/null || userdel --root "$root" blebridge
    else
        userdel blebridge
    fi
    if has_group blebridge; then
        # The kept configuration must not stay owned by a group id that a later user may get.
        local gid
        gid="$(awk -F: '$1 == "blebridge" { print $3 }' "$root/etc/group")"
        if [ -f "$config_path" ] && [ "$(stat -c %g "$config_path")" = "$gid" ]; then
            chgrp 0 "$config_path"
        fi
        if [ -n "$root" ]; then
            groupdel --prefix "$root" blebridge 2>/dev/null || groupdel --root "$root" blebridge
        else
            groupdel blebridge
        fi
    fi
    say "removed user and group blebridge (group bluetooth kept)"
}

if [ "$uninstall" = 1 ]; then
    if systemd_running; then
        systemctl disable --now blebridge.service 2>/dev/null || true
    fi
    remove "$unit_path"
    remove "$bin_path"
    remove "$man_path"
    remove_user
    remove "$sysusers_path"
    if systemd_running && [ "$reload" = 1 ]; then
        systemctl daemon-reload
    fi
    say "kept $config_path and /var/lib/blebridge; delete them yourself if you no longer need them"
    exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [ -z "$binary" ]; then
    [ -f "$repo/Package.swift" ] || die "no --binary given and no Package.swift next to deploy/ to build from"
    if ! command -v swift >/dev/null 2>&1 && [ -x /opt/swift/usr/bin/swift ]; then
        export PATH="/opt/swift/usr/bin:$PATH"
    fi
    command -v swift >/dev/null 2>&1 || die "swift not found: install the Swift toolchain or pass --binary PATH"
    binary="$("$here/build-release.sh")"
fi
[ -f "$binary" ] || die "binary $binary does not exist"

cp "$binary" "$work/blebridge"
"${STRIP:-strip}" --strip-all "$work/blebridge"
size=$(stat -c %s "$work/blebridge")
say "binary: $(awk -v s="$size" 'BEGIN { printf "%.1f MB (%d bytes) stripped", s / 1048576, s }')"
if [ "$size" -gt $((15 * 1024 * 1024)) ]; then
    say "warning: the stripped binary is over 15 MB; deploy/README.md says how to find out why"
fi

put "$work/blebridge" "$bin_path" 0755
put "$here/blebridge.service" "$unit_path" 0644
put "$here/blebridge.sysusers" "$sysusers_path" 0644
put "$here/blebridge.1" "$man_path" 0644
create_user

config_gid() { awk -F: '$1 == "blebridge" { print $3 }' "$root/etc/group"; }
if [ -e "$config_path" ]; then
    say "kept existing $config_path"
    # A configuration kept by --uninstall is root:root 0640; the service reads it through its group.
    mode="$(stat -c '%#a' "$config_path")"
    if [ "$(id -u)" = 0 ] && [ "$(stat -c %g "$config_path")" = 0 ] && [ "$((mode & 4))" = 0 ]; then
        chgrp "$(config_gid)" "$config_path"
        say "made $config_path readable by group blebridge"
    fi
else
    mkdir -p "$config_dir"
    chmod 0755 "$config_dir"
    # 0640 root:blebridge: the service reads it, other users do not (it may name broker credentials).
    put "$repo/config/blebridge.example.yaml" "$config_path" 0640
    if [ "$(id -u)" = 0 ]; then
        chgrp "$(config_gid)" "$config_path"
    fi
fi

if systemd_running && [ "$reload" = 1 ]; then
    systemctl daemon-reload
    say "systemd reloaded"
fi

cat <<EOF

Next steps:
  1. Edit $config_path (the broker URL, your devices; keys in config/README.md), then check it:
       blebridge check-config /etc/blebridge/config.yaml
  2. Start it now and at boot:
       systemctl enable --now blebridge.service
  3. Watch it:
       journalctl -u blebridge -f
     Reload the configuration without a restart with: systemctl reload blebridge
EOF
