#!/usr/bin/env bash
# Build (or verify the cached) Karpenter KWOK provider (sigs.k8s.io/karpenter/kwok) from the Go
# module proxy, plus the CRDs it serves: NodePool, NodeClaim, NodeOverlay (karpenter.sh) and
# KWOKNodeClass (karpenter.kwok.sh), copied from the same module source. The shared steps are
# in hack/lib/gobuild.sh.
#
# The KWOK provider is Karpenter's test cloud: a NodeClaim becomes a Node object (no kubelet)
# labelled kwok.x-k8s.io/node=fake, which the KWOK controller of hack/cluster then runs. The
# `require sigs.k8s.io/karpenter` line of hack/karpenter/go.mod is the pin. Karpenter v1.15.0
# asks for Go >= 1.26.9; when the local go is older, GOTOOLCHAIN fetches that toolchain from the
# Go module proxy (golang.org/toolchain) once.
#
#   ${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/karpenter/<version>-<sha of go.mod, go.sum>/{bin/karpenter-kwok,crds/,.stamp}
#
# Usage:
#   hack/karpenter/build.sh                 build if needed, else verify; prints the output dir last
#   hack/karpenter/build.sh --print-dir     print the output dir (no build); exit 1 if not built yet
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../lib/gobuild.sh
. "$HERE/../lib/gobuild.sh"
GOTOOLCHAIN="go$(sed -n 's/^go //p' "$HERE/go.mod")"

VERSION="$(gobuild_pin "$HERE/go.mod" sigs.k8s.io/karpenter)"
gobuild_dir karpenter "$VERSION" "$(cat "$HERE/go.mod" "$HERE/go.sum" | gobuild_key)"
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
    --print-dir) gobuild_print verify "$OUT" karpenter ;;
    "") ;;
    *) echo "usage: $0 [--print-dir]" >&2; exit 2 ;;
esac

gobuild_begin verify "$OUT" "Karpenter $VERSION KWOK provider" "cold: ~10-20 min on 2 cores"
rm -rf "$OUT/bin.tmp" "$OUT/crds.tmp" && mkdir -p "$OUT/bin.tmp" "$OUT/crds.tmp"
gobuild_go "$HERE" -ldflags "-s -w" -o "$OUT/bin.tmp/karpenter-kwok" sigs.k8s.io/karpenter/kwok

src="$(gobuild_mod_dir "$HERE" sigs.k8s.io/karpenter)"
for f in "${CRDS[@]}"; do
    for d in pkg/apis/crds kwok/apis/crds; do
        [[ -f "$src/$d/$f" ]] && install -m 0644 "$src/$d/$f" "$OUT/crds.tmp/$f"
    done
    [[ -f "$OUT/crds.tmp/$f" ]] || { echo "CRD $f not found in $src" >&2; exit 1; }
done
"$OUT/bin.tmp/karpenter-kwok" --help >/dev/null 2>&1 || { echo "smoke check failed: karpenter-kwok --help" >&2; exit 1; }

gobuild_promote bin crds
gobuild_finish "$OUT" "karpenter=$VERSION" "crds=$(cat "$OUT/crds/"*.yaml | sha256sum | cut -c1-64)"
