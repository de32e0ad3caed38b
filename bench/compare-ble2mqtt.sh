#!/usr/bin/env bash
# blebridge next to ble2mqtt 0.2.5 (PyPI; bleak over dbus-fast) on the same passive load, in one run: bluez-sim on a
# private bus with N RuuviTag advertisers (RAWv2, the payload changes with every advertisement; ble2mqtt has no
# BTHome decoder), a private mosquitto on a free loopback port, and both bridges plus the bare libdbus client
# bench/dbus-ref.c subscribed to the same advertisement signals at the same time. bench/bridge-sub.c runs the window
# and samples /proc/PID/stat (utime+stime), VmHWM and Threads of each process.
#
#   bench/compare-ble2mqtt.sh [--devices N] [--rate HZ] [--window S] [--quick]      (defaults: 50, 1, 20; quick: 10 s)
#
# ble2mqtt is installed into a venv under a temporary directory with pip (ble2mqtt==0.2.5 and whatever bleak pip
# resolves for it, printed below); its config points at the private broker, DBUS_SYSTEM_BUS_ADDRESS at the
# simulator's bus. Each device is configured as type ruuvitag with interval 1 (a state message per second; its
# default is 60 s). ble2mqtt scans in cycles (3 s on, 1 s off) while blebridge scans continuously; both receive every
# advertisement signal on the bus either way (the simulator advertises while anyone scans, DuplicateData on), so
# CPU is divided by the simulator's advertisement count in the window for both. Prints why when ble2mqtt cannot run.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d /opt/swift/usr/bin ] && export PATH="/opt/swift/usr/bin:$PATH"

N=50 RATE=1 WINDOW=20
while [ $# -gt 0 ]; do
    case "$1" in
        --devices) N="${2:?}"; shift 2 ;;
        --rate) RATE="${2:?}"; shift 2 ;;
        --window) WINDOW="${2:?}"; shift 2 ;;
        --quick) WINDOW=10; shift ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "bench/compare-ble2mqtt.sh: unknown option $1 (see --help)" >&2; exit 64 ;;
    esac
done

echo "== build (release)" >&2
for product in blebridge bluez-sim; do
    if ! swift build -c release --product "$product" >"/tmp/bench-build-$$.log" 2>&1; then
        grep -vE '^\[[0-9]+/[0-9]+\]' "/tmp/bench-build-$$.log" | tail -20 >&2
        rm -f "/tmp/bench-build-$$.log"
        echo "release build of $product failed" >&2
        exit 1
    fi
done
rm -f "/tmp/bench-build-$$.log"
BIN="$(swift build -c release --show-bin-path)"
[ -x "$BIN/blebridge" ] && [ -x "$BIN/bluez-sim" ] || { echo "release build failed" >&2; exit 1; }

WORK="$(mktemp -d)"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    [ -n "${KEEP:-}" ] && echo "kept $WORK" >&2 || rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
stop() {
    local pid="$1"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

echo "== ble2mqtt 0.2.5 into a venv" >&2
B2M_OK=1 B2M_WHY=""
if ! python3 -m venv "$WORK/venv" >"$WORK/venv.log" 2>&1; then
    B2M_OK=0 B2M_WHY="python3 -m venv failed: $(tail -1 "$WORK/venv.log")"
elif ! "$WORK/venv/bin/pip" install -q ble2mqtt==0.2.5 >"$WORK/pip.log" 2>&1; then
    B2M_OK=0 B2M_WHY="pip install ble2mqtt==0.2.5 failed: $(tail -1 "$WORK/pip.log")"
else
    echo "   $("$WORK/venv/bin/pip" list 2>/dev/null | grep -iE '^(ble2mqtt|bleak|dbus-fast|aio-mqtt-mod) ' | tr -s ' ' | paste -sd, -)" >&2
fi

cc -O2 -o "$WORK/bridge-sub" bench/bridge-sub.c $(pkg-config --cflags --libs libmosquitto dbus-1) -lpthread
cc -O2 -o "$WORK/dbus-ref" bench/dbus-ref.c $(pkg-config --cflags --libs dbus-1)

PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\nmax_queued_messages 1000000\n' "$PORT" \
    >"$WORK/mosquitto.conf"
MOSQUITTO="$(command -v mosquitto || echo /usr/sbin/mosquitto)"
"$MOSQUITTO" -c "$WORK/mosquitto.conf" >"$WORK/mosquitto.log" 2>&1 &
BROKER=$!
PIDS+=("$BROKER")
for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break; sleep 0.05; done

python3 bench/bridge-gen.py ruuvi "$N" "$RATE" "$PORT" "$WORK"
"$BIN/bluez-sim" --spawn-bus --scenario "$WORK/scenario.yaml" >"$WORK/sim.out" 2>&1 &
SIM=$!
PIDS+=("$SIM")
for _ in $(seq 1 400); do grep -q "bluez-sim: ready" "$WORK/sim.out" && break; sleep 0.05; done
grep -q "bluez-sim: ready" "$WORK/sim.out" || { cat "$WORK/sim.out" >&2; echo "bluez-sim did not start" >&2; exit 1; }
ADDRESS="$(sed -n 's/.*DBUS_SYSTEM_BUS_ADDRESS=//p' "$WORK/sim.out" | head -1)"

"$WORK/dbus-ref" --bus "$ADDRESS" --out "$WORK/ref.rec" >"$WORK/ref.out" 2>&1 &
REF=$!
PIDS+=("$REF")
for _ in $(seq 1 100); do grep -q ready "$WORK/ref.out" && break; sleep 0.05; done

mosquitto_sub -p "$PORT" -t 'ble2mqtt/#' -F '%U %t %p' >"$WORK/b2m.messages" 2>/dev/null &
B2MSUB=$!
PIDS+=("$B2MSUB")

B2M=""
pidargs=()
if [ "$B2M_OK" = 1 ]; then
    DBUS_SYSTEM_BUS_ADDRESS="$ADDRESS" BLE2MQTT_CONFIG="$WORK/ble2mqtt.json" PYTHONUNBUFFERED=1 \
        "$WORK/venv/bin/ble2mqtt" >"$WORK/ble2mqtt.log" 2>&1 &
    B2M=$!
    PIDS+=("$B2M")
    pidargs=(--pid "ble2mqtt=$B2M")
fi
DBUS_SYSTEM_BUS_ADDRESS="$ADDRESS" "$BIN/blebridge" run --config "$WORK/bridge.yaml" 2>"$WORK/bridge.log" &
BRIDGE=$!
PIDS+=("$BRIDGE")

"$WORK/bridge-sub" --port "$PORT" --topic 'blebridge/+' --key measurement_sequence --devices "$N" --settle 3 \
    --window "$WINDOW" --grace 1 --wait-timeout 40 --bus "$ADDRESS" --out "$WORK/sub.rec" \
    --pid "bridge=$BRIDGE" --pid "ref=$REF" --pid "sim=$SIM" "${pidargs[@]}" >"$WORK/samples"

if [ -n "$B2M" ] && ! kill -0 "$B2M" 2>/dev/null; then
    B2M_OK=0
    B2M_WHY="ble2mqtt exited during the run: $(grep -E 'Error|Exception|error' "$WORK/ble2mqtt.log" | tail -1)"
fi
stop "$BRIDGE"
[ -n "$B2M" ] && stop "$B2M"
stop "$REF"
stop "$B2MSUB"
stop "$SIM"

python3 - "$WORK" "$N" "$B2M_OK" "$B2M_WHY" "$RATE" <<'PY'
import re
import sys
work, n, ok, why = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
s = {}
for line in open(work + "/samples"):
    if "=" in line:
        k, v = line.strip().split("=", 1)
        try:
            s[k] = float(v)
        except ValueError:
            s[k] = v
window = s["window_s"]
ads = s.get("sim_advertisements_end", 0) - s.get("sim_advertisements_start", 0)
ws, we = s["window_start_ns"], s["window_end_ns"]
signals = 0
for line in open(work + "/ref.rec"):
    _, t, _, _ = line.split()
    signals += ws <= int(t) <= we
b2m_messages = 0
b2m_states = 0
b2m_example = None
for line in open(work + "/b2m.messages"):
    parts = line.split(" ", 2)
    if len(parts) == 3 and s["window_start_unix"] <= float(parts[0]) <= s["window_end_unix"]:
        b2m_messages += 1
        if re.fullmatch(r"ble2mqtt/0x[0-9a-f]{12}", parts[1]):
            b2m_states += 1
            b2m_example = b2m_example or parts[1] + " " + parts[2].strip()
bridge_messages = s.get("messages_in_window", 0)
print()
print("passive: %d RuuviTag advertisers x %g Hz, window %.1f s: the simulator sent %d advertisements (%.1f/s), "
      "the bare libdbus client saw %d signals" % (n, float(sys.argv[5]), window, ads, ads / window, signals))
print("%-12s %12s %12s %10s %10s %8s %14s" % ("", "CPU s", "µs/adv", "RSS MB", "HWM MB", "threads", "messages/s"))
def row(name, messages):
    cpu = s.get("cpu_%s_s" % name)
    if cpu is None:
        return
    print("%-12s %12.3f %12.1f %10.1f %10.1f %8d %14s" % (
        name, cpu, cpu / max(ads, 1) * 1e6, s.get("rss_%s_kb" % name, 0) / 1024, s.get("hwm_%s_kb" % name, 0) / 1024,
        s.get("threads_%s" % name, 0), messages))
row("bridge", "%.1f" % (bridge_messages / window))
if ok:
    row("ble2mqtt", "%.1f" % (b2m_states / window))
row("ref", "-")
row("sim", "-")
if ok and s.get("cpu_bridge_s"):
    print("ble2mqtt / blebridge CPU: %.1fx; RSS (HWM): %.1fx" % (
        s["cpu_ble2mqtt_s"] / s["cpu_bridge_s"], s.get("hwm_ble2mqtt_kb", 0) / max(s.get("hwm_bridge_kb", 1), 1)))
if not ok:
    print("ble2mqtt could not be measured: " + why)
elif b2m_example:
    print("ble2mqtt state message, for example: " + b2m_example)
else:
    print("ble2mqtt published no state message in the window (see its log below)")
print("(bridge = blebridge run; ref = bench/dbus-ref.c, a bare libdbus client; messages/s = state messages published "
      "in the window; ble2mqtt publishes each device every `interval` = 1 s, blebridge on every changed advertisement)")
PY
if [ "$B2M_OK" = 1 ] || [ -n "$B2M" ]; then
    if grep -qE 'Traceback|Error' "$WORK/ble2mqtt.log"; then
        echo "-- ble2mqtt log (errors, last 15 lines):"
        grep -E 'Traceback|Error|error' "$WORK/ble2mqtt.log" | tail -15
    fi
fi
