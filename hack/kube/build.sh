#!/usr/bin/env bash
# Build (or verify the cached) control-plane binaries from Go modules: etcd, kube-apiserver,
# kube-scheduler, kube-controller-manager, kubectl and kwok, plus KWOK's default Stage YAMLs.
#
# Why a wrapper module: `go install k8s.io/kubernetes/cmd/...@v` is refused because the
# kubernetes module replaces its staging modules; hack/kube/go.mod requires k8s.io/kubernetes
# and replaces every staging module k8s.io/X with k8s.io/X v0.N.P instead. The `require
# k8s.io/kubernetes` line of that go.mod is the one place the Kubernetes version is pinned;
# hack/kube/kwok/go.mod pins KWOK apart from it (its k8s.io libraries differ). The steps shared
# with the other Go builds are in hack/lib/gobuild.sh.
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
# shellcheck source=../lib/gobuild.sh
. "$HERE/../lib/gobuild.sh"

VERSION="$(gobuild_pin "$HERE/go.mod" k8s.io/kubernetes)"
KWOK_VERSION="$(gobuild_pin "$HERE/kwok/go.mod" sigs.k8s.io/kwok)"
gobuild_dir kube "$VERSION" "$(cat "$HERE/go.sum" "$HERE/kwok/go.sum" | gobuild_key)"
BIN="$OUT/bin"
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

built() { [[ -f "$STAMP" ]]; }

case "${1:-}" in
    --print-bindir) gobuild_print built "$BIN" "control-plane binaries" ;;
    --bump) bump "${2:-}"; exit 0 ;;
    "") ;;
    *) echo "usage: $0 [--print-bindir | --bump v1.N.P]" >&2; exit 2 ;;
esac

gobuild_begin built "$BIN" "Kubernetes $VERSION + KWOK $KWOK_VERSION" "cold: ~20 min on 2 cores"
rm -rf "$BIN.tmp" && mkdir -p "$BIN.tmp"

minor="${VERSION#v1.}"; minor="${minor%%.*}"
build_date="$(gobuild_release_time "$HERE" k8s.io/kubernetes)"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit=module-$VERSION -X $pkg.buildDate=$build_date"
done

echo "[1/3] Kubernetes $VERSION + etcd (one go build, shared packages compile once)" >&2
gobuild_go "$HERE" -ldflags "$ldflags" -o "$BIN.tmp/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kubectl \
    go.etcd.io/etcd/server/v3
mv "$BIN.tmp/server" "$BIN.tmp/etcd"  # go names a /vN main package after the element before it

echo "[2/3] KWOK $KWOK_VERSION" >&2
gobuild_go "$HERE/kwok" -ldflags "-s -w" -o "$BIN.tmp/kwok" sigs.k8s.io/kwok/cmd/kwok

echo "[3/3] KWOK stages + smoke check" >&2
kwok_dir="$(gobuild_mod_dir "$HERE/kwok" sigs.k8s.io/kwok)"
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

gobuild_promote bin
gobuild_finish "$BIN" "kubernetes=$VERSION" "kwok=$KWOK_VERSION"
