#!/usr/bin/env bash
# Builds the release binary that deploy/install.sh and deploy/build-deb.sh ship and prints its path (unstripped;
# both strip their copy). The flags, and why (deploy/README.md, "The binary"):
#   --static-swift-stdlib   the Swift runtime and FoundationEssentials go into the binary: no Swift .so at run time
#   --disable-local-rpath   no RUNPATH $ORIGIN: the binary loads system libraries only
#   -Xlinker -z -Xlinker now   full RELRO (BIND_NOW), as Debian's hardening flags give C programs
#   -use-ld=lld, -z pack-relative-relocs
#                              the toolchain's lld, which packs the 27,600 relative relocations of a position-
#                              independent Swift binary into a 6 KB bitmap (DT_RELR, glibc >= 2.36) instead of a
#                              650 KB table the dynamic linker reads, and keeps resident, at every start
#   -function-sections (Swift), -ffunction-sections (C), --symbol-ordering-file and a linker script from
#   deploy/text-order.txt      each function in a section of its own, and the ones the bridge runs laid out together
#                              (scripts/text-order.sh makes the list): the code it touches is a few MB of pages
#                              instead of nearly all of the binary's 7 MB of text, which stays on disk
#   --no-export-dynamic        the Swift toolchain exports every public symbol of the executable (6,400); only the
#                              I/O functions CMosquittoIO interposes for libmosquitto (read, write, close, socketpair)
#                              must be, and the linker exports those by itself because libmosquitto refers to them
# Progress goes to stderr, the path to stdout. BLEBRIDGE_SCRATCH=DIR builds in DIR instead of .build (the benchmarks
# keep the shipped build apart from their own release build, so neither rebuilds the other).
# --product NAME builds another product of the package the same way (bench/adverts.sh measures the BlueZ layer as
# the bridge ships it: bench-adverts).
set -euo pipefail
product=blebridge
if [ "${1:-}" = "--product" ]; then
    product="${2:?build-release.sh: --product needs a name}"
    shift 2
fi
[ $# -eq 0 ] || { echo "build-release.sh: unknown argument $1 (usage: build-release.sh [--product NAME])" >&2; exit 64; }
repo="$(cd "$(dirname "$0")/.." && pwd)"
if ! command -v swift >/dev/null 2>&1 && [ -x /opt/swift/usr/bin/swift ]; then
    export PATH="/opt/swift/usr/bin:$PATH"
fi
command -v swift >/dev/null 2>&1 || { echo "build-release.sh: swift not found on PATH" >&2; exit 1; }
order="$repo/deploy/text-order.txt"
# The list names sections (.text.<symbol>); lld orders by symbol. Its two patterns name the compiler's local helpers
# (.text..L*: object destroyers, metadata accessors; .text.__swift_*), which have no symbol to order by and are
# called from everywhere: a linker script puts all of them (22 KB) in one place ahead of the ordered code, or each
# one touched would keep the pages around it, across the whole text, resident.
layout="${BLEBRIDGE_SCRATCH:-$repo/.build}/layout"
mkdir -p "$layout"
# The standard library's prebuilt Swift.o has its code in one 1.6 MB section: lld places a section where the first
# symbol in it is listed, which would put all of that section between the listed functions. Its symbols go last.
stdlib="$(dirname "$(dirname "$(command -v swift)")")/lib/swift_static/linux/libswiftCore.a"
{ nm -A --defined-only "$stdlib" 2>/dev/null || true; } |
    sed -n 's/^[^:]*:Swift\.o:[0-9a-f]* [tTwW] //p' | sort -u >"$layout/stdlib"
sed -n 's/^\.text\.//p' "$order" | grep -v '[*]' | awk -v lib="$layout/stdlib" '
    BEGIN { while ((getline s < lib) > 0) in_lib[s] = 1 }
    { if ($0 in in_lib) late[++n] = $0; else print }
    END { for (i = 1; i <= n; i++) print late[i] }' >"$layout/symbols.new"
{
    echo "SECTIONS {"
    printf '  .text.hot : {'
    { grep '^\.text\..*[*]' "$order" || true; } | while read -r pattern; do printf ' *(%s)' "$pattern"; done
    echo ' }'
    echo "} INSERT BEFORE .text;"
} >"$layout/helpers.ld.new"
# Rewritten only when they change, so that an unchanged list does not relink (see below).
for f in symbols helpers.ld; do
    cmp -s "$layout/$f.new" "$layout/$f" && rm "$layout/$f.new" || mv "$layout/$f.new" "$layout/$f"
done
flags=(-c release --static-swift-stdlib --disable-local-rpath -Xlinker -z -Xlinker now
    -Xswiftc -use-ld=lld -Xlinker -z -Xlinker pack-relative-relocs
    -Xswiftc -Xfrontend -Xswiftc -function-sections -Xcc -ffunction-sections
    -Xlinker "--symbol-ordering-file=$layout/symbols" -Xlinker --no-warn-symbol-ordering
    -Xlinker -T -Xlinker "$layout/helpers.ld" -Xlinker --no-export-dynamic)
[ -n "${BLEBRIDGE_SCRATCH:-}" ] && flags+=(--scratch-path "$BLEBRIDGE_SCRATCH")
cd "$repo"
bin="$(swift build "${flags[@]}" --show-bin-path)"
built="$bin/$product"
# SwiftPM keeps the objects of a module whose sources did not change when -Xswiftc/-Xcc flags did (they would lack
# their function sections): a build directory last used with other flags is compiled afresh.
stamp="$bin/.build-release-flags"
if [ -d "$bin" ] && [ "$(cat "$stamp" 2>/dev/null)" != "${flags[*]}" ]; then
    echo "build-release.sh: the flags changed since the last build in $bin; compiling every module again" >&2
    # The whole release directory, and the build plan SwiftPM would otherwise reuse (it names files in there).
    rm -rf "$bin" "$(dirname "$(dirname "$bin")")/release.yaml"
fi
# Nor does it relink when only the ordering files changed: a binary older than one of them goes.
for f in "$order" "$layout/symbols" "$layout/helpers.ld"; do
    if [ "$built" -ot "$f" ]; then rm -f "$built"; fi
done
echo "build-release.sh: swift build ${flags[*]} --product $product" >&2
swift build "${flags[@]}" --product "$product" >&2
echo "${flags[*]}" >"$stamp"
echo "$built"
