#!/usr/bin/env bash
# Build (or reuse) the cdi-check helper: a tiny Go program that loads CDI spec files with the
# CDI reference library and injects devices into a sample OCI spec (see main.go).
#
# The binary lives outside the repo, keyed by the hash of main.go, go.mod and go.sum, so fresh
# clones on the same machine reuse it:
#   ${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/cdi-check-<sha>/cdi-check
# Prints the binary's path last. Needs Go and the module proxy on first use (~10 s).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export GOTOOLCHAIN=local CGO_ENABLED=0
GO="${GO:-go}"
KEY="$(cat "$HERE/main.go" "$HERE/go.mod" "$HERE/go.sum" | sha256sum | cut -c1-12)"
OUT="${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/cdi-check-$KEY"
BIN="$OUT/cdi-check"

if [[ "${1:-}" == "--print" ]]; then
    [[ -x "$BIN" ]] || { echo "cdi-check not built; run $0" >&2; exit 1; }
    echo "$BIN"; exit 0
fi
if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9
if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi
(cd "$HERE" && GOFLAGS=-mod=mod "$GO" build -trimpath -ldflags "-s -w" -o "$BIN.tmp" .)
mv "$BIN.tmp" "$BIN"
echo "$BIN"
