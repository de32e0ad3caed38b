#!/usr/bin/env bash
# The bridge demo: on a fresh Debian 12 machine, installs what it needs, builds, starts the simulated sensors of
# config/demo-scenario.yaml on a private D-Bus (bluez-sim; nothing touches a real bluetoothd), a private mosquitto on
# a free loopback port, and `blebridge run --config config/demo.yaml`, then prints the live MQTT traffic
# (`topic payload` per line), sends one /set and one /get and shows their results, and does one round trip of the
# peripheral role (a simulated phone reads a value served from MQTT and writes one that appears on MQTT).
# Runs until interrupted, or for --seconds N. Cleans up on exit. The tools demo is scripts/demo-tools.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_TO_RUN=0
while [ $# -gt 0 ]; do
    case "$1" in
        --seconds) SECONDS_TO_RUN="${2:?--seconds needs a number}"; shift 2 ;;
        --seconds=*) SECONDS_TO_RUN="${1#--seconds=}"; shift ;;
        -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
        *) echo "usage: scripts/demo.sh [--seconds N]" >&2; exit 64 ;;
    esac
done

bash scripts/install-deps.sh
[ -d /opt/swift/usr/bin ] && export PATH="/opt/swift/usr/bin:$PATH"

echo "== build"
swift build --product bluez-sim 2>&1 | grep -vE '^\[[0-9]+/[0-9]+\]' || { echo "build failed" >&2; exit 1; }
swift build --product blebridge 2>&1 | grep -vE '^\[[0-9]+/[0-9]+\]' || { echo "build failed" >&2; exit 1; }
BIN="$(swift build --show-bin-path)"

WORK="$(mktemp -d)"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 0' INT TERM

PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
echo "== start mosquitto on 127.0.0.1:$PORT"
printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\n' "$PORT" >"$WORK/mosquitto.conf"
MOSQUITTO="$(command -v mosquitto || echo /usr/sbin/mosquitto)"
"$MOSQUITTO" -c "$WORK/mosquitto.conf" >"$WORK/mosquitto.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break; sleep 0.05; done

echo "== start bluez-sim (config/demo-scenario.yaml) on a private bus"
"$BIN/bluez-sim" --spawn-bus --scenario config/demo-scenario.yaml >"$WORK/sim.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 200); do grep -q "bluez-sim: ready" "$WORK/sim.out" && break; sleep 0.05; done
grep -q "bluez-sim: ready" "$WORK/sim.out" || { cat "$WORK/sim.out" >&2; echo "bluez-sim did not start" >&2; exit 1; }
export DBUS_SYSTEM_BUS_ADDRESS="$(sed -n 's/.*DBUS_SYSTEM_BUS_ADDRESS=//p' "$WORK/sim.out" | head -1)"
sed -n 's/^bluez-sim: //p' "$WORK/sim.out"

sed "s|mqtt://127.0.0.1:1883|mqtt://127.0.0.1:$PORT|" config/demo.yaml >"$WORK/demo.yaml"
echo "== live MQTT traffic (topic payload), Home Assistant discovery left out"
mosquitto_sub -p "$PORT" -v -t 'blebridge/#' -t 'demo/#' &
PIDS+=($!)
sleep 0.3
echo "== blebridge run --config config/demo.yaml   (its log goes to stderr)"
"$BIN/blebridge" run --config "$WORK/demo.yaml" &
BRIDGE=$!
PIDS=("$BRIDGE" "${PIDS[@]}")

sleep 6
echo "== /set: blebridge/echo/set {\"message\":\"hello\",\"transaction\":1}   (echoed back as the 'echo' field)"
mosquitto_pub -p "$PORT" -t blebridge/echo/set -m '{"message":"hello","transaction":1}'
sleep 1
echo "== /get: blebridge/chest_strap/get {\"battery_pct\":\"\",\"transaction\":2}"
mosquitto_pub -p "$PORT" -t blebridge/chest_strap/get -m '{"battery_pct":"","transaction":2}'
sleep 1
# The peripheral role, one round trip: bluez-sim plays a phone (a remote central) through its control interface.
sim_call() {
    busctl --address="$DBUS_SYSTEM_BUS_ADDRESS" --json=short call org.bluez /org/bluez/sim io.blebridge.Simulator1 "$@"
}
echo "== peripheral: a central connects to the bridge's GATT server and reads Temperature (2A6E)," \
    "served from blebridge/balcony"
sim_call CentralConnect ss "" 5C:F3:70:11:22:33 >/dev/null
HEX="$(sim_call CentralRead ssu 5C:F3:70:11:22:33 2A6E 0 | python3 -c \
    'import json,sys; print(bytes(json.load(sys.stdin)["data"][0]).hex())')"
echo "   read 2A6E: $HEX = $("$BIN/blebridge" decode gatt 2A6E "$HEX")"
echo "== peripheral: the central writes \"hi from BLE\" to the notes characteristic; it appears on demo/from_central"
NOTE="$(python3 -c 'print(" ".join(str(b) for b in b"hi from BLE"))')"
sim_call CentralWrite ssays 5C:F3:70:11:22:33 b1eb4e71-0000-4000-8000-00000000de70 11 $NOTE request >/dev/null

if [ "$SECONDS_TO_RUN" != 0 ]; then
    sleep "$(python3 -c "print(max(0, float('$SECONDS_TO_RUN') - 8))")"
    kill -TERM "$BRIDGE" 2>/dev/null || true
    wait "$BRIDGE" 2>/dev/null || true
    sleep 0.3
    echo "== stopped after $SECONDS_TO_RUN s"
else
    wait "$BRIDGE"
fi
