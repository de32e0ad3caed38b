#!/usr/bin/env bash
# The tools demo: on a fresh Debian 12 machine, installs what it needs, builds blebridge and bluez-sim, starts the simulated
# sensors of config/demo-scenario.yaml on a private D-Bus (nothing touches a real bluetoothd), and shows what the
# blebridge tools see: decoded advertisements, a GATT tree with decoded values, live decoded notifications and a
# write echoed back. Cleans up on exit. DEMO_COUNT=N sets how many heart-rate notifications to show (default 10).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
[ -d /opt/swift/usr/bin ] && export PATH="/opt/swift/usr/bin:$PATH"

echo "== build"
swift build --product bluez-sim 2>&1 | grep -vE '^\[[0-9]+/[0-9]+\]' || { echo "build failed" >&2; exit 1; }
swift build --product blebridge 2>&1 | grep -vE '^\[[0-9]+/[0-9]+\]' || { echo "build failed" >&2; exit 1; }
BIN="$(swift build --show-bin-path)"
COUNT="${DEMO_COUNT:-10}"

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
export DBUS_SYSTEM_BUS_ADDRESS="$(sed -n 's/.*DBUS_SYSTEM_BUS_ADDRESS=//p' "$OUT" | head -1)"
sed -n 's/^bluez-sim: //p' "$OUT"

STRAP=A0:9E:1A:4F:2C:11     # heart-rate strap
THERMO=00:09:1F:84:6C:21    # health thermometer (indications)
ENV=D4:3A:2C:7E:10:05       # environmental sensor
ECHO=F1:E2:D3:C4:B5:A6      # writable device: writes to RX come back as notifications on TX

echo; echo "== bluetoothctl (BlueZ's own client) sees the simulated adapter"
bluetoothctl list

echo; echo "== blebridge scan --duration 3   (advertisements, decoded where a parser exists)"
"$BIN/blebridge" scan --duration 3

echo; echo "== blebridge explore $STRAP   (GATT tree, readable values decoded)"
"$BIN/blebridge" explore "$STRAP"

echo; echo "== blebridge notify $STRAP heart_rate_measurement --count $COUNT   (live, decoded)"
"$BIN/blebridge" notify "$STRAP" heart_rate_measurement --count "$COUNT"

echo; echo "== blebridge notify $THERMO temperature_measurement --count 2   (indications)"
"$BIN/blebridge" notify "$THERMO" temperature_measurement --count 2

echo; echo "== blebridge notify $ENV 2A6E --count 3   (environmental temperature)"
"$BIN/blebridge" notify "$ENV" 2A6E --count 3

echo; echo "== blebridge write $ECHO <RX> 'hello' while listening on <TX>"
"$BIN/blebridge" notify "$ECHO" 6e400003-b5a3-f393-e0a9-e50e24dcca9e --count 1 &
LISTENER=$!
sleep 1
"$BIN/blebridge" write "$ECHO" 6e400002-b5a3-f393-e0a9-e50e24dcca9e 68656c6c6f
wait "$LISTENER"

echo; echo "== blebridge decode gatt 2A37 164a0e01   (the decoder on its own)"
"$BIN/blebridge" decode gatt 2A37 164a0e01
