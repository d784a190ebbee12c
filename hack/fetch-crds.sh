#!/usr/bin/env bash
# Fetch (or reuse) the third-party schemas our deployment files are checked against, so tests
# can install the CRDs into the local control plane and server-side dry-run the overlays:
#   - cert-manager's CRDs (Certificate, Issuer, ...), Kubernetes overlay;
#   - OpenShift's SecurityContextConstraints CRD, OpenShift overlay;
#   - the Prometheus Operator's PodMonitor and PrometheusRule CRDs, components/monitoring;
#   - skaffold's JSON schema for skaffold.yaml (no skaffold binary can be built cheaply here).
#
# All come from Go modules through the Go module proxy (no GitHub downloads here): the
# cert-manager module ships plain CRDs in deploy/crds/, openshift/api ships the SCC CRD in
# security/v1/zz_generated.crd-manifests/, skaffold ships docs-v2/content/en/schemas/*.json.
# Versions are pinned below, with the module sums `go mod download` must report (a changed sum
# is an error, not a silent new schema). openshift/api has no semver tags; the pin is a
# pseudo-version of a release-4.18 commit. The prometheus-operator module ships its CRDs in
# example/prometheus-operator-crd/.
#
# The files land outside the repo, keyed by the pins, so fresh clones reuse them:
#   ${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/crds/<key>/{cert-manager,openshift,prometheus-operator,skaffold}/
# Prints that directory last. Cold: ~10 s (three module zips, ~140 MB); warm: instant.
#
# Usage: hack/fetch-crds.sh [--print-dir]   (--print-dir never downloads; exit 1 if not cached)
set -euo pipefail

export GOTOOLCHAIN=local GOFLAGS=-mod=mod
GO="${GO:-go}"

CERT_MANAGER_MODULE=github.com/cert-manager/cert-manager
CERT_MANAGER_VERSION=v1.21.2
CERT_MANAGER_SUM="h1:UWgoYM+KLNtRlqmoWOKjKBOBUPVHeepQ6/ac3ERJW68="
OPENSHIFT_API_MODULE=github.com/openshift/api
OPENSHIFT_API_VERSION=v0.0.0-20250711200046-c86d80652a9e
OPENSHIFT_API_SUM="h1:E1OdwSpqWuDPCedyUt0GEdoAE+r5TXy7YS21yNEo+2U="
SCC_CRD=security/v1/zz_generated.crd-manifests/0000_03_config-operator_01_securitycontextconstraints-Default.crd.yaml
PROM_OPERATOR_MODULE=github.com/prometheus-operator/prometheus-operator
PROM_OPERATOR_VERSION=v0.85.0
PROM_OPERATOR_SUM="h1:M5xLCLEoaW2IJfnuCwFzzpL+jSVQu3KGT84Pye+fW8s="
PROM_OPERATOR_CRDS=(podmonitors servicemonitors prometheusrules)
SKAFFOLD_MODULE=github.com/GoogleContainerTools/skaffold/v2
SKAFFOLD_VERSION=v2.16.1
SKAFFOLD_SUM="h1:eMrp2qpn/5j2c1P/JqLo+mxcpEIdtokb/tCY2W/05ic="
SKAFFOLD_SCHEMA=v4beta13  # must match skaffold.yaml's apiVersion (tests/unit/test_ops_files.py)

KEY="$(printf '%s\n' "$CERT_MANAGER_VERSION" "$CERT_MANAGER_SUM" "$OPENSHIFT_API_VERSION" \
    "$OPENSHIFT_API_SUM" "$SCC_CRD" "$SKAFFOLD_VERSION" "$SKAFFOLD_SUM" "$SKAFFOLD_SCHEMA" \
    "$PROM_OPERATOR_VERSION" "$PROM_OPERATOR_SUM" "${PROM_OPERATOR_CRDS[@]}" | sha256sum | cut -c1-12)"
OUT="${INSTASLICE_CACHE:-$HOME/.cache/instaslice}/crds/$KEY"
STAMP="$OUT/.stamp"

case "${1:-}" in
    --print-dir)
        [[ -f "$STAMP" ]] || { echo "third-party CRDs not fetched; run $0" >&2; exit 1; }
        echo "$OUT"; exit 0 ;;
    "") ;;
    *) echo "usage: $0 [--print-dir]" >&2; exit 2 ;;
esac
if [[ -f "$STAMP" ]]; then echo "$OUT"; exit 0; fi

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9
if [[ -f "$STAMP" ]]; then echo "$OUT"; exit 0; fi

# download MODULE VERSION SUM -> prints the module's directory in the module cache
download() {
    local json dir sum
    echo "fetching $1@$2 from the Go module proxy" >&2
    # outside any module, so no go.mod of the repo's is consulted or changed
    json="$(cd / && "$GO" mod download -json "$1@$2")" ||
        { echo "go mod download $1@$2 failed" >&2; return 1; }
    dir="$(sed -n 's#^\t"Dir": "\(.*\)",*$#\1#p' <<<"$json")"
    sum="$(sed -n 's#^\t"Sum": "\(.*\)",*$#\1#p' <<<"$json")"
    [[ "$sum" == "$3" ]] || { echo "$1@$2: module sum $sum, expected $3" >&2; return 1; }
    [[ -d "$dir" ]] || { echo "$1@$2: no module dir in: $json" >&2; return 1; }
    echo "$dir"
}

rm -rf "$OUT/cert-manager" "$OUT/openshift" "$OUT/prometheus-operator" "$OUT/skaffold"
mkdir -p "$OUT/cert-manager" "$OUT/openshift" "$OUT/prometheus-operator" "$OUT/skaffold"
cm_dir="$(download "$CERT_MANAGER_MODULE" "$CERT_MANAGER_VERSION" "$CERT_MANAGER_SUM")"
shopt -s nullglob
crds=("$cm_dir"/deploy/crds/*.yaml)
(( ${#crds[@]} > 0 )) || { echo "no CRDs in $cm_dir/deploy/crds" >&2; exit 1; }
install -m 0644 "${crds[@]}" "$OUT/cert-manager/"

os_dir="$(download "$OPENSHIFT_API_MODULE" "$OPENSHIFT_API_VERSION" "$OPENSHIFT_API_SUM")"
[[ -f "$os_dir/$SCC_CRD" ]] || { echo "no $SCC_CRD in $os_dir" >&2; exit 1; }
install -m 0644 "$os_dir/$SCC_CRD" "$OUT/openshift/securitycontextconstraints.crd.yaml"

po_dir="$(download "$PROM_OPERATOR_MODULE" "$PROM_OPERATOR_VERSION" "$PROM_OPERATOR_SUM")"
for crd in "${PROM_OPERATOR_CRDS[@]}"; do
    f="$po_dir/example/prometheus-operator-crd/monitoring.coreos.com_$crd.yaml"
    [[ -f "$f" ]] || { echo "no $f" >&2; exit 1; }
    install -m 0644 "$f" "$OUT/prometheus-operator/"
done

sk_dir="$(download "$SKAFFOLD_MODULE" "$SKAFFOLD_VERSION" "$SKAFFOLD_SUM")"
schema="$sk_dir/docs-v2/content/en/schemas/$SKAFFOLD_SCHEMA.json"
[[ -f "$schema" ]] || { echo "no $schema" >&2; exit 1; }
install -m 0644 "$schema" "$OUT/skaffold/$SKAFFOLD_SCHEMA.json"

{
    echo "cert-manager=$CERT_MANAGER_VERSION"
    echo "openshift-api=$OPENSHIFT_API_VERSION"
    echo "prometheus-operator=$PROM_OPERATOR_VERSION"
    echo "skaffold=$SKAFFOLD_VERSION"
    echo "fetched=$(date -u +%FT%TZ)"
} >"$STAMP"
echo "$OUT"
