#!/usr/bin/env bash
# Build (or verify the cached) helm binary from Go modules, for the Helm chart's checks
# (charts/instaslice, tests/integration/test_helm_chart.py) and docs/install.md "Helm".
# The shared steps are in hack/lib/gobuild.sh.
#
# hack/helm/go.mod is a wrapper module whose `helm.sh/helm/v3` require is the one place the helm
# version is pinned (go.sum holds the checksums). It is kept apart from hack/kube/go.mod so the
# Kubernetes libraries helm was released with are not forced onto the control plane's versions.
#
# The result lives outside the repo, keyed by version, go.mod, go.sum and the ldflags, like the
# control plane's:
#   ${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/helm/<helm version>-<sha>/{bin/helm,.stamp}
#
# Usage:
#   hack/helm/build.sh                 build if needed; prints the bin dir last
#   hack/helm/build.sh --print-bindir  print the bin dir (no build); exit 1 if not built yet
#   hack/helm/build.sh --bump v3.N.P   regenerate go.mod/go.sum for another helm release
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../lib/gobuild.sh
. "$HERE/../lib/gobuild.sh"

case "${1:-}" in
    --bump) gobuild_bump_wrapper "$HERE" v3 helm.sh/helm/v3 helm.sh/helm/v3/cmd/helm "${2:-}" helm; exit 0 ;;
    --print-bindir | "") ;;
    *) echo "usage: $0 [--print-bindir | --bump v3.N.P]" >&2; exit 2 ;;
esac

VERSION="$(gobuild_pin "$HERE/go.mod" helm.sh/helm/v3)"
# The ldflags of helm's own Makefile: its version, and the Kubernetes version `helm template`
# assumes (.Capabilities.KubeVersion) taken from the client-go it is built with (v0.N -> 1.N).
LDFLAGS='-s -w -X helm.sh/helm/v3/internal/version.version=@VERSION@'
LDFLAGS+=' -X helm.sh/helm/v3/internal/version.gitTreeState=clean'
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    LDFLAGS+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=@K8S_MINOR@"
done
gobuild_dir helm "$VERSION" "$( { cat "$HERE/go.mod" "$HERE/go.sum"; echo "$LDFLAGS"; } | gobuild_key)"
BIN="$OUT/bin"

built() { [[ -f "$STAMP" ]]; }

if [[ "${1:-}" == --print-bindir ]]; then gobuild_print built "$BIN" helm; fi
gobuild_begin built "$BIN" "helm $VERSION"
rm -rf "$BIN.tmp" && mkdir -p "$BIN.tmp"

client_go="$(cd "$HERE" && GOFLAGS=-mod=mod "$GO" list -m -f '{{.Version}}' k8s.io/client-go)"
ldflags="${LDFLAGS//@VERSION@/$VERSION}"
ldflags="${ldflags//@K8S_MINOR@/$(echo "$client_go" | cut -d. -f2)}"
gobuild_go "$HERE" -ldflags "$ldflags" -o "$BIN.tmp/helm" helm.sh/helm/v3/cmd/helm

"$BIN.tmp/helm" version --short >"$OUT/.version-helm" 2>&1 ||
    { echo "smoke check failed: helm version" >&2; cat "$OUT/.version-helm" >&2; exit 1; }
grep -q "^$VERSION" "$OUT/.version-helm" ||
    { echo "helm reports $(cat "$OUT/.version-helm"), not $VERSION" >&2; exit 1; }
echo "  helm: $(cat "$OUT/.version-helm")" >&2

gobuild_promote bin
gobuild_finish "$BIN" "helm=$VERSION" "client-go=$client_go"
