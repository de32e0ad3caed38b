#!/usr/bin/env bash
# Builds the release binary that deploy/install.sh and deploy/build-deb.sh ship and prints its path (unstripped;
# both strip their copy). The flags, and why (deploy/README.md, "The binary"):
#   --static-swift-stdlib   the Swift runtime and FoundationEssentials go into the binary: no Swift .so at run time
#   --disable-local-rpath   no RUNPATH $ORIGIN: the binary loads system libraries only
#   -Xlinker -z -Xlinker now   full RELRO (BIND_NOW), as Debian's hardening flags give C programs
#   -function-sections (Swift), -ffunction-sections (C), --section-ordering-file deploy/text-order.txt
#                              each function in a section of its own, and the ones the bridge runs laid out together
#                              (scripts/text-order.sh makes the list): the code it touches is a few MB of pages
#                              instead of nearly all of the binary's 7 MB of text, which stays on disk
#   --no-export-dynamic        the Swift toolchain exports every public symbol of the executable (6,400); only the
#                              I/O functions CMosquittoIO interposes for libmosquitto (read, write, close, socketpair)
#                              must be, and the linker exports those by itself because libmosquitto refers to them
# Progress goes to stderr, the path to stdout. BLEBRIDGE_SCRATCH=DIR builds in DIR instead of .build (the benchmarks
# keep the shipped build apart from their own release build, so neither rebuilds the other).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
if ! command -v swift >/dev/null 2>&1 && [ -x /opt/swift/usr/bin/swift ]; then
    export PATH="/opt/swift/usr/bin:$PATH"
fi
command -v swift >/dev/null 2>&1 || { echo "build-release.sh: swift not found on PATH" >&2; exit 1; }
order="$repo/deploy/text-order.txt"
flags=(-c release --static-swift-stdlib --disable-local-rpath -Xlinker -z -Xlinker now
    -Xswiftc -Xfrontend -Xswiftc -function-sections -Xcc -ffunction-sections
    -Xlinker "--section-ordering-file=$order" -Xlinker --no-export-dynamic)
[ -n "${BLEBRIDGE_SCRATCH:-}" ] && flags+=(--scratch-path "$BLEBRIDGE_SCRATCH")
cd "$repo"
bin="$(swift build "${flags[@]}" --show-bin-path)"
built="$bin/blebridge"
# SwiftPM keeps the objects of a module whose sources did not change when -Xswiftc/-Xcc flags did (they would lack
# their function sections): a build directory last used with other flags is compiled afresh.
stamp="$bin/.build-release-flags"
if [ -d "$bin" ] && [ "$(cat "$stamp" 2>/dev/null)" != "${flags[*]}" ]; then
    echo "build-release.sh: the flags changed since the last build in $bin; compiling every module again" >&2
    # The whole release directory, and the build plan SwiftPM would otherwise reuse (it names files in there).
    rm -rf "$bin" "$(dirname "$(dirname "$bin")")/release.yaml"
fi
# Nor does it relink when only the ordering file changed: a binary older than the file goes.
[ "$built" -ot "$order" ] && rm -f "$built"
echo "build-release.sh: swift build ${flags[*]} --product blebridge" >&2
swift build "${flags[@]}" --product blebridge >&2
echo "${flags[*]}" >"$stamp"
echo "$built"
