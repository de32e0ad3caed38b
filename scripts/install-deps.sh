#!/usr/bin/env bash
# Installs everything blebridge needs to build, test and run its demo on Debian 12.
# Idempotent: skips what is already there. Needs root (or sudo) for apt-get.
set -euo pipefail

DEBS=(pkg-config libdbus-1-dev dbus-daemon dbus-bin libmosquitto-dev mosquitto mosquitto-clients
      libyaml-dev libssl-dev bluez openssl libmicrohttpd-dev prometheus
      systemd dpkg-dev binutils passwd    # deploy tests: systemd-analyze, dpkg-deb/dpkg-shlibdeps, strip, useradd
      bluez-test-scripts python3-dbus python3-gi     # peripheral fidelity test: BlueZ's example-gatt-server etc.
      qemu-system-x86 debootstrap cpio)              # scripts/test-real-bluez.sh: the real-BlueZ VM (TCG) and its image
# Optional: the deploy tests lint the .deb with lintian when it is there and skip that check otherwise; gdb prints
# the threads of a bridge that does not stop when a test asks it to (a diagnosis in the failure, never a verdict).
OPTIONAL_DEBS=(lintian gdb)
PY=(bleak paho-mqtt pytest)

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${DEBS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "install-deps: installing Debian packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # The tests run their own Prometheus on 127.0.0.1; the packaged service would listen on every address (:9090).
    if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
        $SUDO systemctl disable --now prometheus.service >/dev/null 2>&1 || true
    fi
fi

optional=()
for p in "${OPTIONAL_DEBS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || optional+=("$p")
done
if [ ${#optional[@]} -gt 0 ]; then
    echo "install-deps: installing optional Debian packages: ${optional[*]}"
    [ ${#missing[@]} -gt 0 ] || $SUDO apt-get update -qq || true
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${optional[@]}" >/dev/null ||
        echo "install-deps: could not install ${optional[*]}; the tests that need it are skipped"
fi

PYTHON=${PYTHON:-python3}
pymissing=()
for m in bleak paho.mqtt pytest; do
    "$PYTHON" -c "import $m" 2>/dev/null || pymissing+=("$m")
done
if [ ${#pymissing[@]} -gt 0 ]; then
    echo "install-deps: installing Python test tools: ${PY[*]}"
    "$PYTHON" -m pip install -q "${PY[@]}"
fi

if ! command -v swift >/dev/null 2>&1; then
    for d in /opt/swift/usr/bin /usr/share/swift/usr/bin; do
        [ -x "$d/swift" ] && export PATH="$d:$PATH"
    done
fi
command -v swift >/dev/null || { echo "install-deps: swift toolchain not found (expected Swift 6.3 on PATH)" >&2; exit 1; }
