#!/usr/bin/env bash
# The demo: on a fresh Debian 12 machine, installs what it needs, builds bluez-sim, starts it with the demo scenario
# on a private D-Bus (nothing touches the real bluetoothd), and runs a bleak client that scans, connects to the
# simulated heart-rate strap and prints live notifications for ~15 s. Cleans up on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
[ -d /opt/swift/usr/bin ] && export PATH="/opt/swift/usr/bin:$PATH"

echo "== build"
swift build --product bluez-sim 2>&1 | grep -vE '^\[[0-9]+/[0-9]+\]' || { echo "build failed" >&2; exit 1; }
BIN="$(swift build --show-bin-path)"

echo "== start bluez-sim (config/demo-scenario.yaml) on a private bus"
OUT="$(mktemp)"
"$BIN/bluez-sim" --spawn-bus --scenario config/demo-scenario.yaml >"$OUT" 2>&1 &
SIM=$!
cleanup() {
    kill "$SIM" 2>/dev/null || true
    wait "$SIM" 2>/dev/null || true
    rm -f "$OUT"
}
trap cleanup EXIT
for _ in $(seq 1 200); do grep -q "bluez-sim: ready" "$OUT" && break; sleep 0.05; done
grep -q "bluez-sim: ready" "$OUT" || { cat "$OUT" >&2; echo "bluez-sim did not start" >&2; exit 1; }
export DBUS_SYSTEM_BUS_ADDRESS="$(sed -n 's/^DBUS_SYSTEM_BUS_ADDRESS=//p' "$OUT" | head -1)"
sed -n 's/^bluez-sim: //p' "$OUT"

echo "== what bluetoothctl sees"
bluetoothctl list

echo "== what bleak sees"
python3 scripts/demo_client.py
