#!/usr/bin/env bash
# The peripheral role under load: release builds of blebridge and bluez-sim, then bench/peripheral.py per rate
# (values published on MQTT, served by `blebridge serve`, notified to bluez-sim's simulated central). Prints, per
# rate, values sent and notified, lost, out of order, the bridge's CPU µs per value with the simulator's in the same
# run, peak RSS and threads.
#   bench/peripheral.sh [--rates 100,1000] [--window 10]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d /opt/swift/usr/bin ] && export PATH="/opt/swift/usr/bin:$PATH"
RATES="100,1000" WINDOW=10
while [ $# -gt 0 ]; do
    case "$1" in
        --rates) RATES="${2:?}"; shift 2 ;;
        --window) WINDOW="${2:?}"; shift 2 ;;
        -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
        *) echo "bench/peripheral.sh: unknown option $1 (see --help)" >&2; exit 64 ;;
    esac
done
echo "== build (release)" >&2
for product in blebridge bluez-sim; do
    swift build -c release --product "$product" >/tmp/bench-peripheral-build-$$.log 2>&1 ||
        { tail -20 /tmp/bench-peripheral-build-$$.log >&2; rm -f /tmp/bench-peripheral-build-$$.log; exit 1; }
done
rm -f /tmp/bench-peripheral-build-$$.log
BIN="$(swift build -c release --show-bin-path)"
echo "== $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
echo "| rate | sent | notified | lost | out of order | bridge CPU per value | simulator CPU per value | bridge peak RSS | threads |"
echo "|---|---|---|---|---|---|---|---|---|"
IFS=, read -r -a rates <<<"$RATES"
for r in "${rates[@]}"; do
    python3 bench/peripheral.py "$BIN" --rate "$r" --window "$WINDOW" | tail -1
done
