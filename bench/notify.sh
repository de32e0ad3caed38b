#!/usr/bin/env bash
# Notification throughput of bluez-sim over the StartNotify path: builds release binaries, spawns
# `bluez-sim --spawn-bus` with the demo scenario, subscribes one libdbus client (bench-notify) to the writable
# device's TX characteristic and asks the simulator for a burst of N notifications (Simulator1.Burst).
# Prints notifications/s, the lost count and the simulator's CPU time per notification. Target: >= 20,000/s, 0 lost.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d /opt/swift/usr/bin ] && export PATH="/opt/swift/usr/bin:$PATH"
COUNT=${1:-100000}

swift build -c release --product bluez-sim 2>&1 | grep -vE '^\[[0-9]+/[0-9]+\]' >&2
swift build -c release --product bench-notify 2>&1 | grep -vE '^\[[0-9]+/[0-9]+\]' >&2
BIN="$(swift build -c release --show-bin-path)"

OUT="$(mktemp)"
"$BIN/bluez-sim" --spawn-bus --scenario config/demo-scenario.yaml >"$OUT" 2>&1 &
SIM=$!
trap 'kill $SIM 2>/dev/null || true; wait $SIM 2>/dev/null || true; rm -f "$OUT"' EXIT
for _ in $(seq 1 200); do grep -q "bluez-sim: ready" "$OUT" && break; sleep 0.05; done
grep -q "bluez-sim: ready" "$OUT" || { cat "$OUT" >&2; echo "bluez-sim did not start" >&2; exit 1; }
ADDRESS="$(sed -n 's/.*DBUS_SYSTEM_BUS_ADDRESS=//p' "$OUT" | head -1)"

"$BIN/bench-notify" --bus "$ADDRESS" --device F1:E2:D3:C4:B5:A6 \
    --uuid 6e400003-b5a3-f393-e0a9-e50e24dcca9e --count "$COUNT" --sim-pid "$SIM"
