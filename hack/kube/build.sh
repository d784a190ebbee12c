#!/usr/bin/env bash
# Build (or verify the cached) control-plane binaries from Go modules: etcd, kube-apiserver,
# kube-scheduler, kube-controller-manager, kubectl and kwok, plus KWOK's default Stage YAMLs.
#
# Why a wrapper module: `go install k8s.io/kubernetes/cmd/...@v` is refused because the
# kubernetes module replaces its staging modules; hack/kube/go.mod requires k8s.io/kubernetes
# and replaces every staging module k8s.io/X with k8s.io/X v0.N.P instead. The `require
# k8s.io/kubernetes` line of that go.mod is the one place the Kubernetes version is pinned;
# hack/kube/kwok/go.mod pins KWOK apart from it (its k8s.io libraries differ).
#
# The result lives outside the repo, keyed by version and the go.sum files, so fresh clones on
# the same machine reuse it:
#   ${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/kube/<k8s version>-<sha>/{bin,stages,.stamp}
#
# Usage:
#   hack/kube/build.sh                 build if needed; prints the bin dir last
#   hack/kube/build.sh --print-bindir  print the bin dir (no build); exit 1 if not built yet
#   hack/kube/build.sh --bump v1.N.P   regenerate go.mod/go.sum for another Kubernetes release
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export GOTOOLCHAIN=local CGO_ENABLED=0
GO="${GO:-go}"

k8s_version() { sed -n 's#^require k8s.io/kubernetes \(v[^ ]*\)$#\1#p; s#^\tk8s.io/kubernetes \(v[^ ]*\).*#\1#p' "$HERE/go.mod" | head -n1; }
kwok_version() { sed -n 's#^require sigs.k8s.io/kwok \(v[^ ]*\)$#\1#p; s#^\tsigs.k8s.io/kwok \(v[^ ]*\).*#\1#p' "$HERE/kwok/go.mod" | head -n1; }

VERSION="$(k8s_version)"
KWOK_VERSION="$(kwok_version)"
[[ -n "$VERSION" && -n "$KWOK_VERSION" ]] || { echo "cannot read the pins from hack/kube/{,kwok/}go.mod" >&2; exit 1; }
KEY="$(cat "$HERE/go.sum" "$HERE/kwok/go.sum" | sha256sum | cut -c1-12)"
CACHE_ROOT="${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/kube"
OUT="$CACHE_ROOT/$VERSION-$KEY"
BIN="$OUT/bin"
STAMP="$OUT/.stamp"
BINARIES=(etcd kube-apiserver kube-scheduler kube-controller-manager kubectl kwok)

bump() {
    local v="$1" mod
    [[ "$v" =~ ^v1\.([0-9]+)\.([0-9]+)$ ]] || { echo "usage: $0 --bump v1.N.P" >&2; exit 2; }
    mod="$(cd /tmp && GOFLAGS= "$GO" mod download -json "k8s.io/kubernetes@$v" | sed -n 's#^\t"GoMod": "\(.*\)",#\1#p')"
    [[ -f "$mod" ]] || { echo "could not download k8s.io/kubernetes@$v" >&2; exit 1; }
    {
        echo "// Wrapper module: builds Kubernetes binaries from the Go module proxy (hack/kube/build.sh)."
        echo "// Regenerate with hack/kube/build.sh --bump v1.N.P; the k8s.io/kubernetes require is the pin."
        echo "module instaslice.local/kube"
        echo
        echo "go $(sed -n 's/^go //p' "$mod")"
        echo
        echo "require k8s.io/kubernetes $v"
        echo
        echo "tool ("
        for t in kube-apiserver kube-scheduler kube-controller-manager kubectl; do
            printf '\tk8s.io/kubernetes/cmd/%s\n' "$t"
        done
        printf '\tgo.etcd.io/etcd/server/v3\n'
        echo ")"
        echo
        echo "// Every staging module k8s.io/kubernetes replaces with ./staging/src/k8s.io/X."
        echo "replace ("
        sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/src/.*#\1#p' "$mod" |
            while read -r m; do printf '\t%s => %s v0.%s\n' "$m" "$m" "${v#v1.}"; done
        echo ")"
    } >"$HERE/go.mod"
    rm -f "$HERE/go.sum"
    (cd "$HERE" && GOFLAGS=-mod=mod "$GO" mod tidy)
    echo "hack/kube/go.mod now pins k8s.io/kubernetes $v ($(grep -c ' => k8s.io/' "$HERE/go.mod") staging replaces)"
}

case "${1:-}" in
    --print-bindir)
        [[ -f "$STAMP" ]] || { echo "control-plane binaries not built; run make kube-bins" >&2; exit 1; }
        echo "$BIN"; exit 0 ;;
    --bump) bump "${2:-}"; exit 0 ;;
    "") ;;
    *) echo "usage: $0 [--print-bindir | --bump v1.N.P]" >&2; exit 2 ;;
esac

if [[ -f "$STAMP" ]]; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
if ! flock -n 9; then
    echo "waiting for another build of $OUT ..." >&2
    flock 9
fi
if [[ -f "$STAMP" ]]; then  # another process finished it while we waited
    echo "$BIN"
    exit 0
fi

START=$(date +%s)
LOG="$OUT/build.log"
: >"$LOG"
echo "building Kubernetes $VERSION + KWOK $KWOK_VERSION into $OUT (cold: ~20 min on 2 cores; log $LOG)" >&2

# A line every 30 s so a long cold build does not look hung.
(
    while sleep 30; do
        echo "  ... $(( $(date +%s) - START ))s elapsed, $(grep -c . "$LOG" || true) packages built" >&2
    done
) &
TICKER=$!
trap 'kill "$TICKER" 2>/dev/null || true' EXIT

rm -rf "$BIN.tmp" && mkdir -p "$BIN.tmp"

minor="${VERSION#v1.}"; minor="${minor%%.*}"
build_date="$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' \
    "$(cd "$HERE" && GOFLAGS=-mod=mod "$GO" mod download -json k8s.io/kubernetes | sed -n 's#^\t"Info": "\(.*\)",#\1#p')")"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit=module-$VERSION -X $pkg.buildDate=$build_date"
done

echo "[1/3] Kubernetes $VERSION + etcd (one go build, shared packages compile once)" >&2
(
    cd "$HERE"
    GOFLAGS=-mod=mod "$GO" build -v -trimpath -ldflags "$ldflags" -o "$BIN.tmp/" \
        k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
        k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kubectl \
        go.etcd.io/etcd/server/v3
) 2>>"$LOG" || { tail -n 40 "$LOG" >&2; exit 1; }
mv "$BIN.tmp/server" "$BIN.tmp/etcd"  # go names a /vN main package after the element before it

echo "[2/3] KWOK $KWOK_VERSION" >&2
(
    cd "$HERE/kwok"
    GOFLAGS=-mod=mod "$GO" build -v -trimpath -ldflags "-s -w" -o "$BIN.tmp/kwok" sigs.k8s.io/kwok/cmd/kwok
) 2>>"$LOG" || { tail -n 40 "$LOG" >&2; exit 1; }

echo "[3/3] KWOK stages + smoke check" >&2
kwok_dir="$(cd "$HERE/kwok" && GOFLAGS=-mod=mod "$GO" list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
rm -rf "$OUT/stages" && mkdir -p "$OUT/stages"
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
         node/chaos/node-not-ready.yaml \
         pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    install -m 0644 "$kwok_dir/kustomize/stage/$f" "$OUT/stages/$(basename "$f")"
done

for b in "${BINARIES[@]}"; do
    [[ -x "$BIN.tmp/$b" ]] || { echo "missing binary $b" >&2; exit 1; }
    case "$b" in kubectl) vflag=(version --client) ;; *) vflag=(--version) ;; esac
    "$BIN.tmp/$b" "${vflag[@]}" >"$OUT/.version-$b" 2>&1 ||
        { echo "smoke check failed: $b --version" >&2; cat "$OUT/.version-$b" >&2; exit 1; }
    echo "  $b: $(head -n1 "$OUT/.version-$b")" >&2
done
grep -q "$VERSION" "$OUT/.version-kube-apiserver" || { echo "kube-apiserver does not report $VERSION" >&2; exit 1; }

rm -rf "$BIN" && mv "$BIN.tmp" "$BIN"
elapsed=$(( $(date +%s) - START ))
{ echo "kubernetes=$VERSION"; echo "kwok=$KWOK_VERSION"; echo "built=$(date -u +%FT%TZ)"; echo "seconds=$elapsed"; } >"$STAMP"
echo "built in ${elapsed}s; $(du -sh "$BIN" | cut -f1) of binaries" >&2
echo "$BIN"
