#!/usr/bin/env bash
# Builds bench-gatt in release mode and runs it on one core: decodes per second and heap allocations per decode for
# Heart Rate Measurement, Temperature Measurement and BTHome v2 (plain). Allocations are counted by preloading
# bench/malloc-count.c (malloc/calloc/realloc calls). Usage: bench/gatt.sh [SECONDS_PER_CASE]   (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/swift/usr/bin:$PATH"
swift build -c release --product bench-gatt 2>&1 | grep -E "error|warning|Build" || true
mkdir -p .build/bench
clang -O2 -shared -fPIC bench/malloc-count.c -o .build/bench/malloc-count.so
LD_PRELOAD="$PWD/.build/bench/malloc-count.so" exec taskset -c 0 .build/release/bench-gatt "${1:-2}"
