#!/usr/bin/env bash
# Build the krew archive of `kubectl instaslice`: the launcher (plugins/krew/kubectl-instaslice)
# and the project's wheel, as dist/kubectl-instaslice-<version>.tar.gz; print its sha256.
# With --manifest URI, also write that URI and the sha256 into plugins/krew/instaslice.yaml
# (the release step; the URI is where the archive will be published).
#
# Usage: plugins/krew/build-archive.sh [--manifest URI]
# Needs python3 with pip (builds the wheel; first use fetches setuptools from PyPI).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
VERSION="v$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -n1)"
OUT="$ROOT/dist/kubectl-instaslice-$VERSION.tar.gz"

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
SOURCE_DATE_EPOCH=315532800 "$PY" -m pip wheel -q --no-deps -w "$STAGE" "$ROOT" 2>"$STAGE/pip.log" \
    || { cat "$STAGE/pip.log" >&2; exit 1; }
rm -f "$STAGE/pip.log"
install -m 0755 "$HERE/kubectl-instaslice" "$STAGE/kubectl-instaslice"
mkdir -p "$(dirname "$OUT")"
# reproducible for one wheel: fixed order, owner and mtime; gzip without a timestamp
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$STAGE" -cf - \
    kubectl-instaslice "$(cd "$STAGE" && ls instaslice-*.whl)" | gzip -n >"$OUT"
SUM="$(sha256sum "$OUT" | cut -d' ' -f1)"

if [[ "${1:-}" == "--manifest" ]]; then
    URI="${2:?usage: $0 --manifest URI}"
    sed -i -e "s|^\(      uri: \).*|\1$URI|" -e "s|^\(      sha256: \).*|\1\"$SUM\"|" \
        -e "s|^\(  version: \).*|\1$VERSION|" "$HERE/instaslice.yaml"
fi
echo "$OUT"
echo "sha256 $SUM"
