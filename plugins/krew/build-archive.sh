#!/usr/bin/env bash
# Build the krew archive of `kubectl instaslice` (hack/krew_archive.py: the launcher, the
# LICENSE and the plugin's pure-Python code) as dist/kubectl-instaslice-v<version>.tar.gz and
# print its sha256. With --manifest URI, also write that URI, the sha256 and the version into
# plugins/krew/instaslice.yaml. `make release` builds the same archive into .dev/release/ with
# a filled copy of the manifest and SHA256SUMS.
#
# Usage: plugins/krew/build-archive.sh [--manifest URI]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3

read -r OUT < <(cd "$ROOT" && "$PY" -m hack.krew_archive --out "$ROOT/dist")
SUM="$(sha256sum "$OUT" | cut -d' ' -f1)"
if [[ "${1:-}" == "--manifest" ]]; then
    URI="${2:?usage: $0 --manifest URI}"
    (cd "$ROOT" && "$PY" -c 'import sys; from hack.release import KREW_MANIFEST, krew_manifest
KREW_MANIFEST.write_text(krew_manifest(sys.argv[1], sys.argv[2]))' "$URI" "$SUM")
fi
echo "$OUT"
echo "sha256 $SUM"
