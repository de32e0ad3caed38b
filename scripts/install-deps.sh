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

# Home Assistant core, the judge of the bridge's MQTT discovery (Tests/fidelity/test_home_assistant.py), in a
# virtualenv of its own under BLEBRIDGE_HA_VENV (cached like the real-BlueZ VM image). It needs Python 3.13, which
# Debian 12 does not package: the first python3.13 found (PATH, pyenv) is used; without one the reason is written
# next to the virtualenv and that test is skipped saying so. The pins are the release the discovery was judged with
# and the requirements of the integrations it loads (Home Assistant runs with --skip-pip: it installs nothing itself).
HA_VENV=${BLEBRIDGE_HA_VENV:-/var/cache/blebridge-ha/venv}
HA_PINS=(homeassistant==2025.4.4 paho-mqtt==2.1.0 home-assistant-frontend==20250411.0 Pillow==11.1.0 cronsim==2.6
         ifaddr==0.2.0 isal==1.7.1 psutil-home-assistant==0.0.1 securetar==2025.2.1)
if ! "$HA_VENV/bin/python" -c 'import homeassistant.const as c, sys; sys.exit(c.__version__ != "2025.4.4")' \
        2>/dev/null; then
    PY313=""
    for candidate in "$(command -v python3.13 || true)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3.13; do
        if [ -x "$candidate" ] && "$candidate" -c 'import sys, venv; sys.exit(sys.version_info < (3, 13))' 2>/dev/null
        then PY313=$candidate; break; fi
    done
    $SUDO mkdir -p "$(dirname "$HA_VENV")"
    if [ -z "$PY313" ]; then
        echo "no Python 3.13 found (PATH, pyenv); Home Assistant core 2025.4 needs it" |
            $SUDO tee "$(dirname "$HA_VENV")/unavailable" >/dev/null
        echo "install-deps: no Python 3.13: the Home Assistant judge will be skipped"
    else
        echo "install-deps: installing Home Assistant core into $HA_VENV (with $PY313; a few minutes, once)"
        $SUDO rm -rf "$HA_VENV" "$(dirname "$HA_VENV")/unavailable"
        $SUDO "$PY313" -m venv "$HA_VENV"
        $SUDO "$HA_VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
        $SUDO "$HA_VENV/bin/python" -m pip install -q "${HA_PINS[@]}"
    fi
fi

if ! command -v swift >/dev/null 2>&1; then
    for d in /opt/swift/usr/bin /usr/share/swift/usr/bin; do
        [ -x "$d/swift" ] && export PATH="$d:$PATH"
    done
fi
command -v swift >/dev/null || { echo "install-deps: swift toolchain not found (expected Swift 6.3 on PATH)" >&2; exit 1; }
