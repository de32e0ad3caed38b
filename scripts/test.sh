#!/usr/bin/env bash
# Runs blebridge's whole test suite on a fresh Debian 12 machine: installs what it needs, builds,
# runs the Swift tests (unit + integration against a private dbus-daemon, mosquitto and bluez-sim)
# and the Python fidelity tests (bleak, paho-mqtt, bluetoothctl as independent clients), then the deployment tests
# (release build, systemd unit, Debian package, deploy/install.sh into scratch roots), and last the end-to-end checks
# against the real bluetoothd of Debian 12 in a VM (scripts/test-real-bluez.sh, docs/REAL-BLUEZ.md).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
[ -d /opt/swift/usr/bin ] && export PATH="/opt/swift/usr/bin:$PATH"

echo "== build"
swift build --build-tests 2>&1 | grep -vE '^\[[0-9]+/[0-9]+\]' || { echo "build failed" >&2; exit 1; }
BIN_DIR="$(swift build --show-bin-path)"
export BLEBRIDGE_BIN_DIR="$BIN_DIR"

echo "== python fidelity tests (bleak, bluetoothctl, paho-mqtt against our binaries)"
python3 -m pytest -q Tests/fidelity

echo "== swift tests"
swift test --skip-build --parallel --num-workers 2

echo "== deploy tests (release build, systemd unit, .deb, install.sh)"
python3 -m pytest -q Tests/deploy

echo "== real bluetoothd (a VM: Debian 12's bluetoothd, two btvirt controllers, a Bumble peer; docs/REAL-BLUEZ.md)"
# After everything else: the VM is timing-sensitive under TCG and must not share the two cores with the other stages.
bash scripts/test-real-bluez.sh --loops "${REAL_BLUEZ_LOOPS:-3}"
