#!/usr/bin/env bash
# Build (or verify the cached) helm binary from Go modules, for the Helm chart's checks
# (charts/instaslice, tests/integration/test_helm_chart.py) and docs/install.md "Helm".
#
# hack/helm/go.mod is a wrapper module whose `helm.sh/helm/v3` require is the one place the helm
# version is pinned (go.sum holds the checksums). It is kept apart from hack/kube/go.mod so the
# Kubernetes libraries helm was released with are not forced onto the control plane's versions.
#
# The result lives outside the repo, keyed by version, go.sum and this script, like the control
# plane's:
#   ${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/helm/<helm version>-<sha>/{bin/helm,.stamp}
#
# Usage:
#   hack/helm/build.sh                 build if needed; prints the bin dir last
#   hack/helm/build.sh --print-bindir  print the bin dir (no build); exit 1 if not built yet
#   hack/helm/build.sh --bump v3.N.P   regenerate go.mod/go.sum for another helm release
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export GOTOOLCHAIN=local CGO_ENABLED=0
GO="${GO:-go}"

helm_version() { sed -n 's#^require helm.sh/helm/v3 \(v[^ ]*\)$#\1#p; s#^\thelm.sh/helm/v3 \(v[^ ]*\).*#\1#p' "$HERE/go.mod" | head -n1; }

bump() {
    local v="$1"
    [[ "$v" =~ ^v3\.[0-9]+\.[0-9]+$ ]] || { echo "usage: $0 --bump v3.N.P" >&2; exit 2; }
    {
        echo "// Wrapper module: builds helm from the Go module proxy (hack/helm/build.sh)."
        echo "// The helm.sh/helm/v3 require is the pin; regenerate with hack/helm/build.sh --bump v3.N.P."
        echo "module instaslice.local/helm"
        echo
        echo "go $("$GO" env GOVERSION | sed 's/^go\([0-9]*\.[0-9]*\).*/\1.0/')"
        echo
        echo "require helm.sh/helm/v3 $v"
        echo
        echo "tool helm.sh/helm/v3/cmd/helm"
    } >"$HERE/go.mod"
    rm -f "$HERE/go.sum"
    (cd "$HERE" && GOFLAGS=-mod=mod "$GO" mod tidy)
    echo "hack/helm/go.mod now pins helm.sh/helm/v3 $(helm_version)"
}

case "${1:-}" in
    --bump) bump "${2:-}"; exit 0 ;;
    --print-bindir | "") ;;
    *) echo "usage: $0 [--print-bindir | --bump v3.N.P]" >&2; exit 2 ;;
esac

VERSION="$(helm_version)"
[[ -n "$VERSION" ]] || { echo "cannot read the helm.sh/helm/v3 pin from hack/helm/go.mod" >&2; exit 1; }
KEY="$(cat "$HERE/go.sum" "$HERE/build.sh" | sha256sum | cut -c1-12)"  # this script: its ldflags
OUT="${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/helm/$VERSION-$KEY"
BIN="$OUT/bin"
STAMP="$OUT/.stamp"

if [[ "${1:-}" == --print-bindir ]]; then
    [[ -f "$STAMP" ]] || { echo "helm not built; run make kube-bins (or hack/helm/build.sh)" >&2; exit 1; }
    echo "$BIN"; exit 0
fi
if [[ -f "$STAMP" ]]; then echo "$BIN"; exit 0; fi

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
if ! flock -n 9; then echo "waiting for another build of $OUT ..." >&2; flock 9; fi
if [[ -f "$STAMP" ]]; then echo "$BIN"; exit 0; fi  # another process finished it while we waited

START=$(date +%s)
LOG="$OUT/build.log"
: >"$LOG"
echo "building helm $VERSION into $OUT (log $LOG)" >&2
( while sleep 30; do echo "  ... $(( $(date +%s) - START ))s elapsed, $(grep -c . "$LOG" || true) packages built" >&2; done ) &
TICKER=$!
trap 'kill "$TICKER" 2>/dev/null || true' EXIT
rm -rf "$BIN.tmp" && mkdir -p "$BIN.tmp"

# The ldflags of helm's own Makefile: its version, and the Kubernetes version `helm template`
# assumes (.Capabilities.KubeVersion) taken from the client-go it is built with (v0.N -> 1.N).
client_go="$(cd "$HERE" && GOFLAGS=-mod=mod "$GO" list -m -f '{{.Version}}' k8s.io/client-go)"
k8s_minor="$(echo "$client_go" | cut -d. -f2)"
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$VERSION"
ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done

(
    cd "$HERE"
    GOFLAGS=-mod=mod "$GO" build -v -trimpath -ldflags "$ldflags" -o "$BIN.tmp/helm" helm.sh/helm/v3/cmd/helm
) 2>>"$LOG" || { tail -n 40 "$LOG" >&2; exit 1; }

"$BIN.tmp/helm" version --short >"$OUT/.version-helm" 2>&1 ||
    { echo "smoke check failed: helm version" >&2; cat "$OUT/.version-helm" >&2; exit 1; }
grep -q "^$VERSION" "$OUT/.version-helm" ||
    { echo "helm reports $(cat "$OUT/.version-helm"), not $VERSION" >&2; exit 1; }
echo "  helm: $(cat "$OUT/.version-helm")" >&2

rm -rf "$BIN" && mv "$BIN.tmp" "$BIN"
elapsed=$(( $(date +%s) - START ))
{ echo "helm=$VERSION"; echo "client-go=$client_go"; echo "built=$(date -u +%FT%TZ)"; echo "seconds=$elapsed"; } >"$STAMP"
echo "built in ${elapsed}s; $(du -sh "$BIN" | cut -f1) of binaries" >&2
echo "$BIN"
