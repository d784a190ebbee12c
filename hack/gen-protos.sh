#!/usr/bin/env bash
# Generate the kubelet device-plugin (v1beta1), PodResources (v1), DRA plugin (v1), DRA resource
# health (v1) and plugin registration (v1) Python gRPC stubs from the
# .proto files vendored in third_party/k8s.io/kubelet/ (with their license). The generated code
# is committed (nodeagent/deviceplugin/_gen/), so builds need neither Go nor protoc; run this
# (`make protos`) only after changing the vendored protos or the pinned grpcio-tools.
#
#   hack/gen-protos.sh [OUT]        # default OUT: nodeagent/deviceplugin/_gen
#   hack/gen-protos.sh --vendor     # refresh third_party/ from the Go module k8s.io/kubelet
#                                   # ($KUBELET_VERSION, default below), then generate
#
# The protos use gogoproto options, which only affect Go code: they are stripped first. An API
# directory with a hyphen (dra-health) becomes a Python package without it (drahealth).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
VENDOR=third_party/k8s.io/kubelet
APIS=(deviceplugin/v1beta1 podresources/v1 dra/v1 dra-health/v1 pluginregistration/v1)

if [[ "${1:-}" == "--vendor" ]]; then
  VERSION="${KUBELET_VERSION:-v0.37.2}"
  DIR=$(GOFLAGS=-mod=mod GOTOOLCHAIN=local go mod download -json "k8s.io/kubelet@$VERSION" |
    "$PY" -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  install -m 0644 "$DIR/LICENSE" "$VENDOR/LICENSE"
  for p in "${APIS[@]}"; do
    install -D -m 0644 "$DIR/pkg/apis/$p/api.proto" "$VENDOR/pkg/apis/$p/api.proto"
  done
  echo "vendored k8s.io/kubelet@$VERSION protos into $VENDOR (update its README.md)"
  shift
fi

OUT="${1:-nodeagent/deviceplugin/_gen}"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
MODS=("${APIS[@]//-/}")
for i in "${!APIS[@]}"; do
  p=${APIS[$i]} m=${MODS[$i]}
  mkdir -p "$TMP/$m"
  # drop the gogoproto import and every [(gogoproto.x) = y, ...] / option (gogoproto.x) = y;
  sed -E -e '/gogoproto\/gogo.proto/d' -e '/^option \(gogoproto\./d' \
    -e 's/ *\[\(gogoproto\.[^]]*\]//g' "$VENDOR/pkg/apis/$p/api.proto" >"$TMP/$m/api.proto"
done
rm -rf "$OUT" && mkdir -p "$OUT"
"$PY" -m grpc_tools.protoc -I "$TMP" --python_out="$OUT" --grpc_python_out="$OUT" \
  "${MODS[@]/%//api.proto}"
# the generated *_pb2_grpc imports `from deviceplugin.v1beta1 import api_pb2`: make it relative
for m in "${MODS[@]}"; do
  sed -i -E "s/^from ${m//\//\\.} import api_pb2/from . import api_pb2/" "$OUT/$m/api_pb2_grpc.py"
  touch "$OUT/${m%%/*}/__init__.py" "$OUT/$m/__init__.py"
done
touch "$OUT/__init__.py"
echo "generated kubelet gRPC stubs in $OUT from $VENDOR"
