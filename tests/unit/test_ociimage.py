"""hack/cluster/ociimage.py: the OCI layout tarballs the real node imports. Covers the
layout's consistency (every digest names its blob, the config's diff_id is the uncompressed
layer), the image name `ctr images import` reads, the layer's entries, and determinism.
Leaves out importing them (tests/e2e/test_realnode.py does, into a real containerd)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

from hack.cluster.ociimage import BUSYBOX_APPLETS, BUSYBOX_IMAGE, busybox_image


def _read(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {
            m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isfile()
        }


def test_busybox_image_is_a_consistent_oci_layout(tmp_path: Path) -> None:
    fake = tmp_path / "busybox"
    fake.write_bytes(b"\x7fELF not really")
    out = busybox_image(tmp_path / "bb.tar", fake)
    files = _read(out)
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1], name
    (entry,) = json.loads(files["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == BUSYBOX_IMAGE
    manifest = json.loads(files["blobs/sha256/" + entry["digest"].split(":")[1]])
    config = json.loads(files["blobs/sha256/" + manifest["config"]["digest"].split(":")[1]])
    layer_gz = files["blobs/sha256/" + manifest["layers"][0]["digest"].split(":")[1]]
    layer = gzip.decompress(layer_gz)
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["bin/busybox"].size == len(b"\x7fELF not really")
    assert all(members[f"bin/{a}"].linkname == "busybox" for a in BUSYBOX_APPLETS)
    assert {"sh", "ls", "env", "cat", "sleep"} <= set(BUSYBOX_APPLETS)
    again = busybox_image(tmp_path / "bb2.tar", fake)
    assert again.read_bytes() == out.read_bytes()  # deterministic
