#!/usr/bin/env bash
# Generate the kubelet device-plugin (v1beta1) and PodResources (v1) Python gRPC stubs from
# the .proto files that ship in the k8s.io/kubelet Go module (the version pinned by
# hack/kube/go.mod's Kubernetes). Output: nodeagent/deviceplugin/_gen/ (git-ignored).
# The protos use gogoproto options, which only affect Go code: they are stripped first.
# Idempotent: does nothing when the stubs for this version already exist.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${KUBELET_VERSION:-v0.37.2}"
PY="${PY:-.venv/bin/python}"
OUT=nodeagent/deviceplugin/_gen
STAMP="$OUT/.version-$VERSION"
[[ -f "$STAMP" ]] && exit 0

DIR=$(GOFLAGS=-mod=mod GOTOOLCHAIN=local go mod download -json "k8s.io/kubelet@$VERSION" |
  "$PY" -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for p in deviceplugin/v1beta1 podresources/v1; do
  mkdir -p "$TMP/$p"
  # drop the gogoproto import and every [(gogoproto.x) = y, ...] / option (gogoproto.x) = y;
  sed -E -e '/gogoproto\/gogo.proto/d' -e '/^option \(gogoproto\./d' \
    -e 's/ *\[\(gogoproto\.[^]]*\]//g' "$DIR/pkg/apis/$p/api.proto" >"$TMP/$p/api.proto"
done
rm -rf "$OUT" && mkdir -p "$OUT/deviceplugin/v1beta1" "$OUT/podresources/v1"
"$PY" -m grpc_tools.protoc -I "$TMP" --python_out="$OUT" --grpc_python_out="$OUT" \
  deviceplugin/v1beta1/api.proto podresources/v1/api.proto
# the generated *_pb2_grpc imports `from deviceplugin.v1beta1 import api_pb2`: make it relative
for p in deviceplugin/v1beta1 podresources/v1; do
  sed -i -E "s/^from ${p//\//\\.} import api_pb2/from . import api_pb2/" "$OUT/$p/api_pb2_grpc.py"
  touch "$OUT/${p%%/*}/__init__.py" "$OUT/$p/__init__.py"
done
touch "$OUT/__init__.py" "$STAMP"
echo "generated kubelet gRPC stubs ($VERSION) in $OUT"
