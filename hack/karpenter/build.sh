#!/usr/bin/env bash
# Build (or verify the cached) Karpenter KWOK provider (sigs.k8s.io/karpenter/kwok) from the Go
# module proxy, plus the CRDs it serves: NodePool, NodeClaim, NodeOverlay (karpenter.sh) and
# KWOKNodeClass (karpenter.kwok.sh), copied from the same module source.
#
# The KWOK provider is Karpenter's test cloud: a NodeClaim becomes a Node object (no kubelet)
# labelled kwok.x-k8s.io/node=fake, which the KWOK controller of hack/cluster then runs. The
# `require sigs.k8s.io/karpenter` line of hack/karpenter/go.mod is the pin. Karpenter v1.15.0
# asks for Go >= 1.26.9; when the local go is older, GOTOOLCHAIN fetches that toolchain from the
# Go module proxy (golang.org/toolchain) once.
#
#   ${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/karpenter/<version>-<sha>/{bin/karpenter-kwok,crds/,.stamp}
#
# Usage:
#   hack/karpenter/build.sh                 build if needed, else verify; prints the output dir last
#   hack/karpenter/build.sh --print-dir     print the output dir (no build); exit 1 if not built yet
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
GO="${GO:-go}"
GOVERSION_NEEDED="$(sed -n 's/^go //p' "$HERE/go.mod")"
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN="go$GOVERSION_NEEDED"

VERSION="$(sed -n 's#^require sigs.k8s.io/karpenter \(v[^ ]*\)$#\1#p; s#^\tsigs.k8s.io/karpenter \(v[^ ]*\).*#\1#p' "$HERE/go.mod" | head -n1)"
[[ -n "$VERSION" ]] || { echo "cannot read the sigs.k8s.io/karpenter pin from hack/karpenter/go.mod" >&2; exit 1; }
KEY="$(cat "$HERE/go.mod" "$HERE/go.sum" | sha256sum | cut -c1-12)"
OUT="${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/karpenter/$VERSION-$KEY"
STAMP="$OUT/.stamp"
CRDS=(karpenter.sh_nodepools.yaml karpenter.sh_nodeclaims.yaml karpenter.sh_nodeoverlays.yaml
      karpenter.kwok.sh_kwoknodeclasses.yaml)

verify() {  # the cached result is whole: binary answers, every CRD is there and names its kind
    [[ -f "$STAMP" && -x "$OUT/bin/karpenter-kwok" ]] || return 1
    "$OUT/bin/karpenter-kwok" --help >/dev/null 2>&1 || return 1
    local f
    for f in "${CRDS[@]}"; do grep -q '^kind: CustomResourceDefinition' "$OUT/crds/$f" 2>/dev/null || return 1; done
    [[ "$(cat "$OUT/crds/"*.yaml | sha256sum | cut -c1-64)" == "$(sed -n 's/^crds=//p' "$STAMP")" ]]
}

case "${1:-}" in
    --print-dir) verify || { echo "karpenter not built; run make kube-bins" >&2; exit 1; }; echo "$OUT"; exit 0 ;;
    "") ;;
    *) echo "usage: $0 [--print-dir]" >&2; exit 2 ;;
esac

if verify; then echo "$OUT"; exit 0; fi
mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock -n 9 || { echo "waiting for another build of $OUT ..." >&2; flock 9; }
if verify; then echo "$OUT"; exit 0; fi
rm -f "$STAMP"

START=$(date +%s)
LOG="$OUT/build.log"
: >"$LOG"
echo "building Karpenter $VERSION KWOK provider into $OUT (cold: ~10-20 min on 2 cores; log $LOG)" >&2
( while sleep 30; do echo "  ... $(( $(date +%s) - START ))s elapsed, $(grep -c . "$LOG" || true) packages built" >&2; done ) &
TICKER=$!
trap 'kill "$TICKER" 2>/dev/null || true' EXIT

rm -rf "$OUT/bin.tmp" "$OUT/crds.tmp" && mkdir -p "$OUT/bin.tmp" "$OUT/crds.tmp"
( cd "$HERE" && "$GO" build -v -trimpath -ldflags "-s -w" -o "$OUT/bin.tmp/karpenter-kwok" sigs.k8s.io/karpenter/kwok ) \
    2>>"$LOG" || { tail -n 40 "$LOG" >&2; exit 1; }

src="$(cd "$HERE" && "$GO" list -m -f '{{.Dir}}' sigs.k8s.io/karpenter)"
for f in "${CRDS[@]}"; do
    for d in pkg/apis/crds kwok/apis/crds; do
        [[ -f "$src/$d/$f" ]] && install -m 0644 "$src/$d/$f" "$OUT/crds.tmp/$f"
    done
    [[ -f "$OUT/crds.tmp/$f" ]] || { echo "CRD $f not found in $src" >&2; exit 1; }
done
"$OUT/bin.tmp/karpenter-kwok" --help >/dev/null 2>&1 || { echo "smoke check failed: karpenter-kwok --help" >&2; exit 1; }

rm -rf "$OUT/bin" "$OUT/crds" && mv "$OUT/bin.tmp" "$OUT/bin" && mv "$OUT/crds.tmp" "$OUT/crds"
elapsed=$(( $(date +%s) - START ))
{ echo "karpenter=$VERSION"; echo "crds=$(cat "$OUT/crds/"*.yaml | sha256sum | cut -c1-64)"
  echo "built=$(date -u +%FT%TZ)"; echo "seconds=$elapsed"; } >"$STAMP"
echo "built in ${elapsed}s; $(du -sh "$OUT/bin" | cut -f1) of binaries" >&2
echo "$OUT"
