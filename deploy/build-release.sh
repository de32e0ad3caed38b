#!/usr/bin/env bash
# Builds the release binary that deploy/install.sh and deploy/build-deb.sh ship and prints its path (unstripped;
# both strip their copy). The flags, and why (deploy/README.md, "The binary"):
#   --static-swift-stdlib   the Swift runtime and FoundationEssentials go into the binary: no Swift .so at run time
#   --disable-local-rpath   no RUNPATH $ORIGIN: the binary loads system libraries only
#   -Xlinker -z -Xlinker now   full RELRO (BIND_NOW), as Debian's hardening flags give C programs
# Progress goes to stderr, the path to stdout. BLEBRIDGE_SCRATCH=DIR builds in DIR instead of .build (the benchmarks
# keep the shipped build apart from their own release build, so neither rebuilds the other).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
if ! command -v swift >/dev/null 2>&1 && [ -x /opt/swift/usr/bin/swift ]; then
    export PATH="/opt/swift/usr/bin:$PATH"
fi
command -v swift >/dev/null 2>&1 || { echo "build-release.sh: swift not found on PATH" >&2; exit 1; }
flags=(-c release --static-swift-stdlib --disable-local-rpath -Xlinker -z -Xlinker now)
[ -n "${BLEBRIDGE_SCRATCH:-}" ] && flags+=(--scratch-path "$BLEBRIDGE_SCRATCH")
cd "$repo"
echo "build-release.sh: swift build ${flags[*]} --product blebridge" >&2
swift build "${flags[@]}" --product blebridge >&2
echo "$(swift build "${flags[@]}" --show-bin-path)/blebridge"
