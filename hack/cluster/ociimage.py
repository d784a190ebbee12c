"""Single-layer OCI image tarballs from local files, for the real node (no registry here).

`write_image(out, name, files, ...)` writes an OCI image-layout tarball (`oci-layout`,
`index.json` naming the image in `io.containerd.image.name`, `blobs/sha256/*` with a gzip
layer, the config and the manifest) that `ctr images import` accepts as is. Deterministic:
fixed mtimes and owners, so the same inputs give the same digests.

`pause_image` and `busybox_image` are the two images the real node imports at start:
the sandbox image (a static pause built by hack/kube/build-node.sh) and
`localhost/instaslice/busybox:test` (Debian's busybox-static with sh, ls, env, cat, sleep).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BUSYBOX_APPLETS",
    "BUSYBOX_IMAGE",
    "PAUSE_IMAGE",
    "Entry",
    "busybox_image",
    "pause_image",
    "write_image",
]

PAUSE_IMAGE = "localhost/instaslice/pause:test"
BUSYBOX_IMAGE = "localhost/instaslice/busybox:test"
BUSYBOX_APPLETS = ("sh", "ls", "env", "cat", "sleep", "head", "grep", "true", "echo", "test")
_EPOCH = 0


@dataclass(frozen=True)
class Entry:
    """One layer entry: a host file copied in (`source`), a symlink (`link`), or a dir."""

    path: str  # inside the image, absolute
    source: Path | None = None
    link: str | None = None
    mode: int = 0o755


def _layer(entries: Sequence[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.path.lstrip("/"))
            info.mtime, info.mode, info.uid, info.gid = _EPOCH, e.mode, 0, 0
            if e.source is not None:
                data = e.source.read_bytes()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            elif e.link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, e.link
                tar.addfile(info)
            else:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
    return buf.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest.split(':', 1)[1]}")
    info.size, info.mtime, info.mode = len(data), _EPOCH, 0o644
    tar.addfile(info, io.BytesIO(data))
    return digest, len(data)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_image(
    out: Path,
    name: str,
    entries: Sequence[Entry],
    *,
    entrypoint: Sequence[str] = (),
    cmd: Sequence[str] = (),
) -> Path:
    """Write the image `name` (e.g. `localhost/x/y:tag`) as an OCI layout tarball at `out`."""
    layer = _layer(entries)
    gz = gzip.compress(layer, mtime=_EPOCH)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            **({"Entrypoint": list(entrypoint)} if entrypoint else {}),
            **({"Cmd": list(cmd)} if cmd else {}),
        },
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w") as tar:
        layer_digest, layer_size = _blob(tar, gz)
        config_digest, config_size = _blob(tar, _json(config))
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": config_size,
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": layer_digest,
                    "size": layer_size,
                }
            ],
        }
        manifest_digest, manifest_size = _blob(tar, _json(manifest))
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": manifest_size,
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
                    },
                }
            ],
        }
        for fname, data in (
            ("oci-layout", _json({"imageLayoutVersion": "1.0.0"})),
            ("index.json", _json(index)),
        ):
            info = tarfile.TarInfo(fname)
            info.size, info.mtime, info.mode = len(data), _EPOCH, 0o644
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(out)
    return out


def pause_image(out: Path, pause_binary: Path) -> Path:
    return write_image(
        out, PAUSE_IMAGE, [Entry("/pause", source=pause_binary)], entrypoint=["/pause"]
    )


def busybox_image(out: Path, busybox: Path = Path("/bin/busybox")) -> Path:
    dirs = ["/bin", "/dev", "/proc", "/sys", "/tmp", "/etc", "/root"]
    entries = [Entry(d, mode=0o1777 if d == "/tmp" else 0o755) for d in dirs]
    entries.append(Entry("/bin/busybox", source=busybox))
    entries += [Entry(f"/bin/{a}", link="busybox") for a in BUSYBOX_APPLETS]
    return write_image(out, BUSYBOX_IMAGE, entries, cmd=["sh"])
