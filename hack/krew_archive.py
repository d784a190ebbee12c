"""The krew archive of `kubectl instaslice`: runs on first use with no download.

The archive holds the launcher (plugins/krew/kubectl-instaslice), the project's LICENSE, and
under `lib/` the pure-Python code the plugin runs: the `common` package (the plugin and what it
imports; it reads the cluster through kubectl, so no Kubernetes client library) and PyYAML's
pure-Python `yaml` package with its licence under `licenses/`. No compiled code, so one archive
serves every platform; no virtualenv and no PyPI on first run (older archives installed a wheel
from PyPI there). Reproducible: fixed order, owner and mtime, gzip without a timestamp.

Usage: python -m hack.krew_archive [--out DIR]   (prints the archive's path and sha256)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata
import io
import tarfile
from pathlib import Path

import yaml

from common.version import VERSION
from hack.cluster.bins import REPO_ROOT

LAUNCHER = REPO_ROOT / "plugins" / "krew" / "kubectl-instaslice"


def archive_name(version: str = VERSION) -> str:
    return f"kubectl-instaslice-v{version}.tar.gz"


def _package_files(root: Path, package: str) -> dict[str, Path]:
    """Every source and data file of a package directory, by its name in the archive."""
    out = {}
    for f in sorted((root / package).rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".pyc", ".so"):
            out[f"lib/{f.relative_to(root).as_posix()}"] = f
    return out


def _pyyaml_license() -> bytes:
    dist = importlib.metadata.distribution("PyYAML")
    for f in dist.files or []:
        if f.name.upper().startswith("LICENSE"):
            return Path(str(dist.locate_file(f))).read_bytes()
    raise SystemExit("PyYAML's LICENSE is not installed: cannot ship its code without it")


def contents() -> dict[str, tuple[bytes, int]]:
    """Archive member name -> (bytes, mode)."""
    yaml_root = Path(yaml.__file__).resolve().parent.parent
    files = {"kubectl-instaslice": (LAUNCHER.read_bytes(), 0o755),
             "LICENSE": ((REPO_ROOT / "LICENSE").read_bytes(), 0o644),
             "licenses/PyYAML-LICENSE": (_pyyaml_license(), 0o644)}  # fmt: skip
    for name, path in {**_package_files(REPO_ROOT, "common"),
                       **_package_files(yaml_root, "yaml")}.items():  # fmt: skip
        files[name] = (path.read_bytes(), 0o644)
    return files


def build(out_dir: Path) -> tuple[Path, str]:
    """Write the archive into out_dir; return its path and sha256."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for name, (data, mode) in sorted(contents().items()):
            parts = name.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    tar.addfile(_info(d, 0, 0o755, tarfile.DIRTYPE))
            tar.addfile(_info(name, len(data), mode, tarfile.REGTYPE), io.BytesIO(data))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / archive_name()
    data = gzip.compress(buf.getvalue(), mtime=0)
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def _info(name: str, size: int, mode: int, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.type, info.mtime = size, mode, kind, 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "dist")
    args = p.parse_args()
    path, sha = build(args.out)
    print(path)
    print(f"sha256 {sha}")


if __name__ == "__main__":
    main()
