#!/usr/bin/env bash
# libFuzzer run over every GATT decoder (Fuzz/GATTFuzz.swift + Sources/GATT, compiled with -sanitize=fuzzer; set
# ASAN=1 to add AddressSanitizer, ~10x slower: Swift's own bounds checks already trap on out-of-range access).
# Not part of CI. Seeds: the payloads of Tests/Fixtures/vectors.json. Prints executions and crashes; exits 1 when a
# crash was found (the input is kept under .build/fuzz/).
# Usage: bench/fuzz.sh [SECONDS]   (default 60)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/swift/usr/bin:$PATH"
seconds="${1:-60}"
out=.build/fuzz
rm -rf "$out/crashes"
mkdir -p "$out/corpus" "$out/crashes"

sources=$(find Sources/GATT -name '*.swift' | sort)
echo "compiling the fuzz target ($(echo "$sources" | wc -l) GATT sources + Fuzz/GATTFuzz.swift)..."
sanitizers=fuzzer
if [ "${ASAN:-0}" = 1 ]; then sanitizers=fuzzer,address; fi
# shellcheck disable=SC2086
swiftc -sanitize="$sanitizers" -parse-as-library -O -module-name GATTFuzz \
    $sources Fuzz/GATTFuzz.swift -o "$out/gatt-fuzz" 2>&1 | { grep -v "Cannot export local symbol" || true; }

python3 - "$out/corpus" <<'PY'
import json, sys, os
for v in json.load(open("Tests/Fixtures/vectors.json")):
    with open(os.path.join(sys.argv[1], v["id"]), "wb") as f:
        f.write(bytes.fromhex(v["payload_hex"]))
PY

echo "fuzzing for ${seconds} s..."
set +e
"$out/gatt-fuzz" -max_total_time="$seconds" -print_final_stats=1 -max_len=128 -timeout=10 \
    -artifact_prefix="$out/crashes/" "$out/corpus" >"$out/log.txt" 2>&1
status=$?
set -e
executions=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$out/log.txt" | grep -oE '[0-9]+$' || echo "?")
rate=$(grep -oE 'stat::average_exec_per_sec: *[0-9]+' "$out/log.txt" | grep -oE '[0-9]+$' || echo "?")
coverage=$(grep -oE 'cov: [0-9]+' "$out/log.txt" | tail -1 | grep -oE '[0-9]+' || echo "?")
crashes=$(find "$out/crashes" -type f | wc -l)
echo "sanitizers: ${sanitizers}; executions: ${executions} (${rate}/s), coverage: ${coverage} edges, crashes: ${crashes}"
if [ "$crashes" -gt 0 ] || [ "$status" -ne 0 ]; then
    grep -E "ERROR|Fatal error|==[0-9]+==" "$out/log.txt" | head -20
    find "$out/crashes" -type f
    exit 1
fi
