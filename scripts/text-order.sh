#!/usr/bin/env bash
# Regenerates deploy/text-order.txt, the order in which deploy/build-release.sh has the linker lay out the code of
# the shipped blebridge: every function the bridge runs first, together, so that the pages of code it touches are
# few and the rest of the binary is never read in (deploy/README.md, "The binary", says why and what it saves).
#
#   scripts/text-order.sh            runs the bridge under valgrind (callgrind) through bench/bridge.sh's scenarios
#                                    at small sizes, and writes deploy/text-order.txt
#
# Run it after changes that add or rename much code on the bridge's paths: a function the file does not list still
# works, it is only laid out with the cold code (bench/bridge.sh's peak RSS shows the difference). Needs valgrind
# (installed with apt-get when missing) and takes about 10 minutes on two cores.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
[ -d /opt/swift/usr/bin ] && export PATH="/opt/swift/usr/bin:$PATH"
if ! command -v valgrind >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO=sudo
    echo "text-order: installing valgrind" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends valgrind >/dev/null
fi

binary="$(BLEBRIDGE_SCRATCH="$repo/.build/shipped" bash deploy/build-release.sh)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# valgrind cannot read the DWARF of this toolchain's clang; the symbol table is all it needs.
objcopy --strip-debug "$binary" "$work/blebridge"
mkdir "$work/out"
cat >"$work/run" <<EOF
#!/usr/bin/env bash
exec valgrind -q --tool=callgrind --demangle=no --compress-strings=no --dump-line=no --dump-instr=no \\
    --callgrind-out-file="$work/out/callgrind.%p" "$work/blebridge" "\$@"
EOF
chmod +x "$work/run"

# Every scenario of bench/bridge.sh, small enough for the bridge to keep up under valgrind: start-up, connects,
# notifications (also in gathered rounds), advertisements, Home Assistant discovery, availability, shutdown.
echo "text-order: running the bridge under callgrind (bench/bridge.sh --quick, then notify at 150 and 200/s)" >&2
BRIDGE_BIN="$work/run" bash bench/bridge.sh --quick >"$work/bench1.log" 2>&1 || true
BRIDGE_BIN="$work/run" bash bench/bridge.sh --only notify-a,notify-b --notify-a 3x50 --notify-b 10x20 --window 5 \
    >"$work/bench2.log" 2>&1 || true
runs="$(find "$work/out" -name 'callgrind.*' -size +0 | wc -l)"
[ "$runs" -ge 6 ] || { tail -30 "$work/bench1.log" "$work/bench2.log" >&2; echo "text-order: only $runs runs" >&2; exit 1; }

# The functions that ran (callgrind's fn= and cfn= lines), kept when the binary defines them as code.
grep -h -E '^c?fn=' "$work"/out/callgrind.* | sed -E 's/^c?fn=(\([0-9]+\) )?//' | sort -u >"$work/ran"
nm --defined-only "$binary" | awk '$2 ~ /^[tTwW]$/ { print $3 }' | sort -u >"$work/code"
# What the list held before and the binary still defines stays: a path these runs did not take (a warning logged
# to MQTT, a reconnect) was taken by an earlier run, and one such function among the cold code costs a whole
# fault-around block of resident text.
[ -f deploy/text-order.txt ] && sed -n 's/^\.text\.\([^*]*\)$/\1/p' deploy/text-order.txt >>"$work/ran"
sort -u -o "$work/ran" "$work/ran"
{
    # Sections without a symbol of their own: the compiler's unnamed helpers (metadata accessors the runtime calls
    # while it resolves types, object destroyers) and the runtime's __swift_* value-witness helpers, a few
    # bytes each and spread over every object file.
    echo '.text..L*'
    echo '.text.__swift_*'
    comm -12 "$work/ran" "$work/code" | sed 's/^/.text./'
} >deploy/text-order.txt
echo "text-order: deploy/text-order.txt lists $(($(wc -l <deploy/text-order.txt) - 2)) functions from $runs runs" >&2
