#!/bin/bash
# The check runner inside the real-BlueZ VM (started by the VM's init). Arguments: RIG OUT
#   RIG  read-only share: RIG/blebridge (our static binary), RIG/realbluez (this directory)
#   OUT  writable share: results.txt (PASS/FAIL lines and the summary), status (0 when every check passed),
#        bluetoothd.log (bluetoothd -n -d), dbus-monitor.log (dbus-monitor --system), hci.btsnoop (btmon),
#        peer.log, checks/<name>.log (each command's output), failures/<n>/ (the explore-then-read iterations that
#        failed, with the slices of bluetoothd.log and dbus-monitor.log that cover them)
# A check that cannot run because an earlier step failed is reported as "SKIP name: not run (...)", counted apart.
set -u
RIG="$1"
OUT="$2"
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
BLEBRIDGE="$RIG/blebridge"
PEER_ADDR="F0:B1:E8:00:00:01"
SERVICE="6e400001-b5a3-f393-e0a9-e50e24dcca9e"
READ_CHAR="6e400002-b5a3-f393-e0a9-e50e24dcca9e"
WRITE_CHAR="6e400003-b5a3-f393-e0a9-e50e24dcca9e"
NOTIFY_CHAR="6e400004-b5a3-f393-e0a9-e50e24dcca9e"
LOOPS="${REAL_BLUEZ_LOOPS:-10}"
[ -f "$RIG/loops" ] && LOOPS="$(cat "$RIG/loops")"
mkdir -p "$OUT/checks"
: > "$OUT/results.txt"
echo 1 > "$OUT/status"
pass=0 fail=0 skip=0
t0=$(date +%s.%N)
elapsed() { awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
result() {  # result PASS|FAIL|SKIP name [reason]
    local line="$1 $2"; [ $# -gt 2 ] && line="$line: $3"
    echo "$line" | tee -a "$OUT/results.txt"
    case "$1" in PASS) pass=$((pass + 1)) ;; FAIL) fail=$((fail + 1)) ;; *) skip=$((skip + 1)) ;; esac
}
note() { echo "[vm $(elapsed) s] $*" | tee -a "$OUT/timeline.txt"; }
# wait_for SECONDS COMMAND...: polls COMMAND (every 0.2 s) until it succeeds; the state is what we wait for.
wait_for() {
    local limit="$1"; shift
    local deadline; deadline=$(( $(date +%s) + limit ))
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -ge "$deadline" ] && return 1
        sleep 0.2
    done
}
finish() {
    note "checks done: $pass passed, $fail failed, $skip not run"
    echo "SUMMARY $pass passed, $fail failed, $skip not run" | tee -a "$OUT/results.txt"
    kill "$MONITOR_PID" "$BTMON_PID" 2>/dev/null
    kill -INT "$BLUETOOTHD_PID" 2>/dev/null
    sleep 0.5
    kill "$PEER_PID" "$BTVIRT_PID" 2>/dev/null
    sync
    if [ "$fail" = 0 ] && [ "$skip" = 0 ]; then echo 0 > "$OUT/status"; else echo 1 > "$OUT/status"; fi
    exit 0
}
skip_rest() {  # skip_rest REASON NAME...
    local reason="$1"; shift
    for n in "$@"; do result SKIP "$n" "not run ($reason)"; done
    finish
}
MONITOR_PID="" BTMON_PID="" BLUETOOTHD_PID="" PEER_PID="" BTVIRT_PID=""
ALL_AFTER_BTVIRT=(btvirt-two-controllers peer-advertising bluetoothd-one-controller scan-sees-peer explore-lists-gatt
                  read-characteristic write-characteristic notify-characteristic explore-then-read-loop)
note "vm-checks start; kernel $(uname -r); $(bluetoothctl --version 2>/dev/null)"

# --- the system bus and the broker (loopback only) ---
mkdir -p /run/dbus /var/run/mosquitto
dbus-daemon --system --fork || skip_rest "dbus-daemon did not start" "${ALL_AFTER_BTVIRT[@]}"
printf 'listener 1883 127.0.0.1\nallow_anonymous true\n' > /tmp/mosquitto.conf
mosquitto -c /tmp/mosquitto.conf -d
dbus-monitor --system > "$OUT/dbus-monitor.log" 2>&1 &
MONITOR_PID=$!
note "dbus-daemon and dbus-monitor up"

# --- btvirt: two LE controllers on one emulated link ---
modprobe hci_vhci || skip_rest "modprobe hci_vhci failed" "${ALL_AFTER_BTVIRT[@]}"
btmon -w "$OUT/hci.btsnoop" > /dev/null 2>&1 &
BTMON_PID=$!
btvirt -L -l2 > "$OUT/btvirt.log" 2>&1 &
BTVIRT_PID=$!
two_controllers() { [ -e /sys/class/bluetooth/hci0 ] && [ -e /sys/class/bluetooth/hci1 ]; }
if wait_for 20 two_controllers; then
    result PASS btvirt-two-controllers
else
    result FAIL btvirt-two-controllers "after 20 s /sys/class/bluetooth holds: $(ls /sys/class/bluetooth | tr '\n' ' ')"
    skip_rest "no two controllers" "${ALL_AFTER_BTVIRT[@]:1}"
fi
note "btvirt up"

# --- the peer on hci1, opened before bluetoothd starts ---
/opt/bumble/bin/python3 "$RIG/realbluez/peer.py" 1 "$PEER_ADDR" /tmp/peer-ready > "$OUT/peer.log" 2>&1 &
PEER_PID=$!
if wait_for 90 test -s /tmp/peer-ready; then
    result PASS peer-advertising
else
    result FAIL peer-advertising "no advertising after 90 s; peer.log: $(tail -3 "$OUT/peer.log" | tr '\n' ' ')"
    skip_rest "no peer" "${ALL_AFTER_BTVIRT[@]:2}"
fi
note "peer advertising"

# --- the real bluetoothd ---
# Each line gets the wall-clock time in front (seconds since the epoch), the same clock as dbus-monitor's time=.
/usr/libexec/bluetooth/bluetoothd -n -d > >(python3 -u -c '
import sys, time
for line in sys.stdin:
    sys.stdout.write(f"{time.time():.6f} {line}")
' > "$OUT/bluetoothd.log") 2>&1 &
BLUETOOTHD_PID=$!
bluez_on_bus() {
    dbus-send --system --print-reply --dest=org.bluez / org.freedesktop.DBus.ObjectManager.GetManagedObjects |
        grep -q org.bluez.Adapter1
}
powered() { bluetoothctl show | grep -q 'Powered: yes'; }
if wait_for 30 bluez_on_bus && wait_for 15 powered; then
    bluetoothctl list > "$OUT/checks/bluetoothctl-list.log" 2>&1
    n=$(grep -c '^Controller' "$OUT/checks/bluetoothctl-list.log")
    if [ "$n" = 1 ]; then
        result PASS bluetoothd-one-controller
    else
        result FAIL bluetoothd-one-controller "bluetoothctl list shows $n controllers: $(tr '\n' ' ' < "$OUT/checks/bluetoothctl-list.log")"
    fi
else
    result FAIL bluetoothd-one-controller "bluetoothd has no powered adapter on the bus after 45 s"
    skip_rest "no adapter" "${ALL_AFTER_BTVIRT[@]:3}"
fi
note "bluetoothd up: $(bluetoothctl list | tr '\n' ' ')"

# --- our CLI against it ---
run() {  # run NAME TIMEOUT COMMAND...: output to checks/NAME.log; returns the command's status
    local name="$1" limit="$2"; shift 2
    { echo "\$ $*"; } > "$OUT/checks/$name.log"
    timeout "$limit" "$@" >> "$OUT/checks/$name.log" 2>&1
}
if run scan 30 "$BLEBRIDGE" scan --duration 8 && grep -qi "$PEER_ADDR" "$OUT/checks/scan.log"; then
    result PASS scan-sees-peer
else
    result FAIL scan-sees-peer "$PEER_ADDR not in the scan output ($(tail -2 "$OUT/checks/scan.log" | tr '\n' ' '))"
fi
note "scan done"
if run explore 60 "$BLEBRIDGE" explore "$PEER_ADDR" --verbose && grep -qi "$SERVICE" "$OUT/checks/explore.log" &&
    grep -qi "$READ_CHAR" "$OUT/checks/explore.log"; then
    result PASS explore-lists-gatt
else
    result FAIL explore-lists-gatt "status or tree wrong: $(grep -v '^\[' "$OUT/checks/explore.log" | tail -2 | tr '\n' ' ')"
fi
note "explore done"
if run read 60 "$BLEBRIDGE" read "$PEER_ADDR" "$READ_CHAR" --hex --verbose &&
    grep -qi '68656c6c6f207265616c20626c75657a\|68 65 6c 6c 6f' "$OUT/checks/read.log"; then
    result PASS read-characteristic
else
    result FAIL read-characteristic "$(grep -v '^\[debug\]' "$OUT/checks/read.log" | tail -2 | tr '\n' ' ')"
fi
note "read done"
if run write 60 "$BLEBRIDGE" write "$PEER_ADDR" "$WRITE_CHAR" c0ffee --verbose &&
    run write-readback 60 "$BLEBRIDGE" read "$PEER_ADDR" "$WRITE_CHAR" --hex --verbose &&
    grep -qi 'c0ffee\|c0 ff ee' "$OUT/checks/write-readback.log" && grep -q 'write c0ffee' "$OUT/peer.log"; then
    result PASS write-characteristic
else
    result FAIL write-characteristic "$(cat "$OUT/checks/write.log" "$OUT/checks/write-readback.log" 2>/dev/null |
        grep -v '^\[debug\]' | tail -2 | tr '\n' ' ')"
fi
note "write done"
if run notify 60 "$BLEBRIDGE" notify "$PEER_ADDR" "$NOTIFY_CHAR" --count 3 --hex --verbose &&
    [ "$(grep -v '^\[\|^\$' "$OUT/checks/notify.log" | grep -c .)" -ge 3 ]; then
    result PASS notify-characteristic
else
    result FAIL notify-characteristic "$(grep -v '^\[debug\]' "$OUT/checks/notify.log" | tail -2 | tr '\n' ' ')"
fi
note "notify done"

# --- issue #13: read right after explore, LOOPS times ---
ok=0 bad=0
mkdir -p "$OUT/failures"
: > "$OUT/checks/loop-summary.log"
for i in $(seq 1 "$LOOPS"); do
    b0=$(wc -l < "$OUT/bluetoothd.log"); m0=$(wc -l < "$OUT/dbus-monitor.log")
    dbus-send --system --type=signal /org/blebridge/rig org.blebridge.Rig.Marker string:"iteration $i start" 2>/dev/null
    s=$(date +%s.%N)
    run "loop-$i-explore" 60 "$BLEBRIDGE" explore "$PEER_ADDR" --verbose; e1=$?
    run "loop-$i-read" 60 "$BLEBRIDGE" read "$PEER_ADDR" "$READ_CHAR" --hex --verbose; e2=$?
    took=$(awk -v a="$s" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    dbus-send --system --type=signal /org/blebridge/rig org.blebridge.Rig.Marker string:"iteration $i end" 2>/dev/null
    sleep 0.3   # lets dbus-monitor and bluetoothd flush the lines of this iteration before the slice is cut
    if [ "$e1" = 0 ] && [ "$e2" = 0 ]; then
        ok=$((ok + 1)); echo "iteration $i: ok (${took} s)" >> "$OUT/checks/loop-summary.log"
    else
        bad=$((bad + 1))
        why="explore exit $e1, read exit $e2: $(grep -v '^\[debug\]' "$OUT/checks/loop-$i-read.log" | tail -1)"
        echo "iteration $i: FAILED (${took} s) $why" >> "$OUT/checks/loop-summary.log"
        d="$OUT/failures/$i"; mkdir -p "$d"
        kill -USR2 "$PEER_PID" 2>/dev/null && sleep 1   # the peer logs its state (see peer.py)
        tail -n 40 "$OUT/peer.log" > "$d/peer.log"
        cp "$OUT/checks/loop-$i-explore.log" "$OUT/checks/loop-$i-read.log" "$d/"
        tail -n +"$((b0 + 1))" "$OUT/bluetoothd.log" > "$d/bluetoothd.log"
        tail -n +"$((m0 + 1))" "$OUT/dbus-monitor.log" > "$d/dbus-monitor.log"
    fi
    note "loop $i: explore $e1 read $e2 (${took} s)"
done
if [ "$LOOPS" = 0 ]; then
    result SKIP explore-then-read-loop "not run (--loops 0)"
elif [ "$bad" = 0 ]; then
    result PASS explore-then-read-loop "$ok/$LOOPS iterations passed"
else
    result FAIL explore-then-read-loop "$ok/$LOOPS iterations passed; failing ones in failures/ ($(grep FAILED "$OUT/checks/loop-summary.log" | head -1))"
fi
finish
