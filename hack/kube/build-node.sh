#!/usr/bin/env bash
# Build (or verify the cached) binaries of the real node (docs/control-plane.md "Real node"):
# kubelet, a static pause, containerd + ctr + containerd-shim-runc-v2, the CNI loopback plugin
# and NVIDIA's container runtime (nvidia-container-runtime, for the env binding mode).
# runc and busybox come from Debian packages (`make install-node-deps`), not from here.
#
# kubelet builds from hack/kube/node/go.mod: hack/kube/go.mod plus the kubelet tool, pinned to
# the same k8s.io/kubernetes (checked below), so it speaks the control plane's version. The
# others are built inside their own released modules (their go.mod, go.sum and replaces), copied
# out of the Go module cache; the versions are pinned here. The steps shared with the other Go
# builds are in hack/lib/gobuild.sh.
#
# Cache, outside the repo like the control plane's, keyed by the pins and the go.sum:
#   ${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/node/<k8s version>-<sha>/{bin,src,.stamp}
#
# Usage:
#   hack/kube/build-node.sh                 build if needed; prints the bin dir last
#   hack/kube/build-node.sh --print-bindir  print the bin dir (no build); exit 1 if not built
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../lib/gobuild.sh
. "$HERE/../lib/gobuild.sh"

CONTAINERD_VERSION=v2.4.2
CNI_PLUGINS_VERSION=v1.10.0
NVIDIA_CTK_VERSION=v1.20.2

VERSION="$(gobuild_pin "$HERE/go.mod" k8s.io/kubernetes)"
[[ -n "$VERSION" && "$VERSION" == "$(gobuild_pin "$HERE/node/go.mod" k8s.io/kubernetes)" ]] || {
    echo "hack/kube/node/go.mod must pin the k8s.io/kubernetes of hack/kube/go.mod ($VERSION);" \
         "regenerate it (docs/control-plane.md)" >&2; exit 1; }
gobuild_dir node "$VERSION" "$( { cat "$HERE/node/go.sum" "$HERE/node/pause/main.go"
                                  echo "$CONTAINERD_VERSION $CNI_PLUGINS_VERSION $NVIDIA_CTK_VERSION"; } | gobuild_key)"
BIN="$OUT/bin"
BINARIES=(kubelet pause containerd ctr containerd-shim-runc-v2 loopback nvidia-container-runtime)

built() { [[ -f "$STAMP" ]]; }

case "${1:-}" in
    --print-bindir) gobuild_print built "$BIN" "real-node binaries" ;;
    "") ;;
    *) echo "usage: $0 [--print-bindir]" >&2; exit 2 ;;
esac
gobuild_begin built "$BIN" "the real node ($VERSION kubelet, containerd $CONTAINERD_VERSION)"
rm -rf "$BIN.tmp" && mkdir -p "$BIN.tmp" "$OUT/src"

# A released module's source, writable, in $OUT/src (the module cache is read-only).
module_src() {
    local mod="$1" ver="$2" dir dest="$OUT/src/${1##*/}@$2"
    if [[ ! -d "$dest" ]]; then
        dir="$(cd /tmp && GOFLAGS= "$GO" mod download -json "$mod@$ver" | sed -n 's#^\t"Dir": "\(.*\)",#\1#p')"
        [[ -d "$dir" ]] || { echo "could not download $mod@$ver" >&2; exit 1; }
        rm -rf "$dest.tmp" && cp -r "$dir" "$dest.tmp" && chmod -R u+w "$dest.tmp" && mv "$dest.tmp" "$dest"
    fi
    echo "$dest"
}

minor="${VERSION#v1.}"; minor="${minor%%.*}"
build_date="$(gobuild_release_time "$HERE/node" k8s.io/kubernetes)"
kube_ld="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    kube_ld+=" -X $pkg.gitVersion=$VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    kube_ld+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit=module-$VERSION -X $pkg.buildDate=$build_date"
done

echo "[1/5] containerd $CONTAINERD_VERSION, ctr, containerd-shim-runc-v2" >&2
src="$(module_src github.com/containerd/containerd/v2 "$CONTAINERD_VERSION")"
ctrd_ld="-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
ctrd_ld+=" -X github.com/containerd/containerd/v2/version.Revision=module"
tags="urfave_cli_no_docs osusergo netgo static_build no_btrfs no_devmapper no_zfs"  # no cgo here
gobuild_go "$src" -tags "$tags" -ldflags "$ctrd_ld" -o "$BIN.tmp/" ./cmd/containerd ./cmd/ctr
gobuild_go "$src" -tags "$tags no_grpc" -ldflags "$ctrd_ld" -o "$BIN.tmp/" ./cmd/containerd-shim-runc-v2

echo "[2/5] CNI loopback $CNI_PLUGINS_VERSION" >&2
src="$(module_src github.com/containernetworking/plugins "$CNI_PLUGINS_VERSION")"
gobuild_go "$src" -ldflags "-s -w" -o "$BIN.tmp/" ./plugins/main/loopback

echo "[3/5] pause (hack/kube/node/pause)" >&2
gobuild_go "$HERE/node" -ldflags "-s -w" -o "$BIN.tmp/pause" ./pause

echo "[4/5] nvidia-container-runtime $NVIDIA_CTK_VERSION" >&2
src="$(module_src github.com/NVIDIA/nvidia-container-toolkit "$NVIDIA_CTK_VERSION")"
# the only cgo build here: internal/cuda dlopens libcuda (needs gcc + libc headers, not CUDA)
CGO_ENABLED=1 gobuild_go "$src" -ldflags "-s -w" -o "$BIN.tmp/" ./cmd/nvidia-container-runtime

echo "[5/5] kubelet $VERSION (warm Go cache from make kube-bins: ~2 min)" >&2
gobuild_go "$HERE/node" -ldflags "$kube_ld" -o "$BIN.tmp/kubelet" k8s.io/kubernetes/cmd/kubelet

for b in "${BINARIES[@]}"; do
    [[ -x "$BIN.tmp/$b" ]] || { echo "missing binary $b" >&2; exit 1; }
done
"$BIN.tmp/kubelet" --version >"$OUT/.version-kubelet" 2>&1
grep -q "$VERSION" "$OUT/.version-kubelet" || { echo "kubelet does not report $VERSION" >&2; exit 1; }
"$BIN.tmp/containerd" --version >"$OUT/.version-containerd" 2>&1
grep -q "$CONTAINERD_VERSION" "$OUT/.version-containerd" ||
    { echo "containerd does not report $CONTAINERD_VERSION" >&2; exit 1; }
echo "  $(cat "$OUT/.version-kubelet"); $(cat "$OUT/.version-containerd")" >&2

gobuild_promote bin
gobuild_finish "$BIN" "kubernetes=$VERSION" "containerd=$CONTAINERD_VERSION" "cni=$CNI_PLUGINS_VERSION" \
    "nvidia-ctk=$NVIDIA_CTK_VERSION"
