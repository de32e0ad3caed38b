#!/usr/bin/env bash
# Builds bench-gatt in release mode and runs it: decodes per second (one core) and heap allocations per decode for
# Heart Rate Measurement, Temperature Measurement and BTHome v2 (plain). Usage: bench/gatt.sh [SECONDS_PER_CASE]
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/swift/usr/bin:$PATH"
swift build -c release --product bench-gatt 2>&1 | grep -v "symbol name 'malloc' is reserved" | grep -E "error|Compiling|Build" || true
# One core, so the figure is per core whatever else the machine runs.
exec taskset -c 0 .build/release/bench-gatt "${1:-2}"
