#!/usr/bin/env bash
# Multi-gateway hand-over (issue #12): two gateways (one bluez-sim on its own private bus and one `blebridge run`
# each, release build), one private mosquitto on loopback, the same heart-rate strap heard at -50 dBm by the first
# and -80 dBm by the second. It measures
#   - the hand-over time: the owner is killed with SIGKILL (and its simulator drops the links, as a gateway that
#     lost power would), and the time runs until the other gateway's first reading of the strap reaches a
#     subscriber; the killed gateway is started again before the next round (the hand-over margin keeps it from
#     taking the strap back), so the owner alternates; p50 and max over ROUNDS hand-overs;
#   - what coordination costs on MQTT in a steady minute: claim and sightings messages (and bytes) per device per
#     minute, with DEVICES straps and PASSIVE BTHome thermometers (heard by both), and for the thermometers the
#     states published against the distinct readings (duplicates) and whose RSSI they carry.
#   bench/handover.sh [--rounds 20] [--devices 10] [--passive 10] [--steady 60]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d /opt/swift/usr/bin ] && export PATH="/opt/swift/usr/bin:$PATH"
ROUNDS=20 DEVICES=10 PASSIVE=10 STEADY=60
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) ROUNDS="${2:?}"; shift 2 ;;
        --devices) DEVICES="${2:?}"; shift 2 ;;
        --steady) STEADY="${2:?}"; shift 2 ;;
        --passive) PASSIVE="${2:?}"; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "bench/handover.sh: unknown option $1 (see --help)" >&2; exit 64 ;;
    esac
done
echo "== build (release)" >&2
for product in bluez-sim blebridge; do
    swift build -c release --product "$product" 2>&1 | grep -vE '^\[[0-9]+/[0-9]+\]' >&2
done
BLEBRIDGE_BIN_DIR="$(swift build -c release --show-bin-path)" exec python3 bench/handover.py \
    --rounds "$ROUNDS" --devices "$DEVICES" --passive "$PASSIVE" --steady "$STEADY"
