"""`make images`: the webhook and node-agent images, built here from the repo's Containerfiles.

Nothing is pulled from an image registry (this machine reaches only PyPI, the Go module proxy,
npm and Debian's archive). The Containerfiles' production base (UBI 9 Python 3.11) stays their
default; here `BASE_IMAGE` is a Debian bookworm root made by `mmdebstrap` from Debian
packages (python3.11 + venv, the same /usr/bin/python3.11 the Containerfiles call), imported
into Buildah's store. Buildah (`bud --isolation chroot`, overlay storage, `--layers`) runs the
Containerfiles unchanged, so the images hold the wheel tests/packaging/test_wheel.py checks,
with the versions constraints.txt pins. The results leave as `docker-archive` tarballs
(`<out>/<component>.tar`, the image tagged `dev-<image id>`) that `ctr images import` loads
onto the real node (hack/cluster/chartinstall.py).

Caching (outside the repo, `~/.cache/instaslice/images/`): the base tarball is keyed by its
inputs (suite, mirror, packages, this module's recipe version), so a warm rebuild skips
mmdebstrap; Buildah's store there keeps the layers, so an unchanged tree rebuilds from cache
and a code change reruns only the last RUN (the pinned dependencies are their own layer).

Behind a TLS-intercepting proxy the build mounts the host's CA bundle for pip (the
Containerfiles' `PIP_CERT` build argument); it is not part of any image.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.version import VERSION
from hack.cluster.bins import REPO_ROOT

__all__ = [
    "COMPONENTS",
    "IMAGE_TAG",
    "Built",
    "ImageError",
    "build_images",
    "image_name",
    "main",
]

COMPONENTS = ("webhook", "nodeagent")
IMAGE_TAG = "dev"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3.11", "python3.11-venv", "ca-certificates")
_RECIPE = "1"  # bump when the mmdebstrap options below change: it is part of the cache key
_MMDEBSTRAP_OPTS = (
    "--variant=minbase",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    '--aptopt=Acquire::Retries "3"',
)
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
_RUNROOT = Path("/run/instaslice-buildah")


class ImageError(RuntimeError):
    """A build step failed; the message names the step and its log."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "instaslice" / "images"


def image_name(component: str) -> str:
    """The name Buildah builds (`localhost/...`: never pulled); `Built.name` is its
    content-tagged twin that the chart's values point at."""
    return f"localhost/instaslice/instaslice-{component}:{IMAGE_TAG}"


def base_key() -> str:
    recipe = "\n".join((_RECIPE, SUITE, MIRROR, *BASE_PACKAGES, *_MMDEBSTRAP_OPTS))
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def base_image() -> str:
    return f"localhost/instaslice/debian-python:{SUITE}-{base_key()}"


def _buildah(*args: str) -> list[str]:
    driver = os.environ.get("INSTASLICE_BUILDAH_DRIVER", "overlay")
    return [
        "buildah",
        f"--root={cache_dir() / f'buildah-{driver}'}",
        f"--runroot={_RUNROOT}-{driver}",
        f"--storage-driver={driver}",
        *args,
    ]


def _run(step: str, argv: Sequence[str], log: Path) -> str:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=f, text=True, check=False)
        f.write(proc.stdout)
    if proc.returncode != 0:
        raise ImageError(f"{step} failed (rc {proc.returncode}); see {log}")
    return proc.stdout.strip()


def _check_tools() -> None:
    missing = [t for t in ("buildah", "mmdebstrap") if shutil.which(t) is None]
    if missing:
        raise ImageError(
            f"{', '.join(missing)} missing: apt-get install buildah mmdebstrap (Debian packages)"
        )


def ensure_base(log: Path) -> str:
    """The Debian base in Buildah's store, made (and cached) on first use."""
    name = base_image()
    if subprocess.run(_buildah("inspect", name), capture_output=True).returncode == 0:
        return name
    tar = cache_dir() / f"base-{SUITE}-{base_key()}.tar"
    if not tar.exists():
        tmp = tar.with_name(tar.name + ".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        argv = ["mmdebstrap", *_MMDEBSTRAP_OPTS, f"--include={','.join(BASE_PACKAGES)}"]
        _run("mmdebstrap", [*argv, SUITE, str(tmp), MIRROR], log)
        tmp.replace(tar)
    ctr = _run("buildah from scratch", _buildah("from", "scratch"), log).splitlines()[-1]
    try:
        _run("buildah add base", _buildah("add", ctr, str(tar), "/"), log)
        path = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        _run("buildah config", _buildah("config", f"--env={path}", ctr), log)
        _run("buildah commit base", _buildah("commit", "--rm", ctr, name), log)
    except ImageError:
        subprocess.run(_buildah("rm", ctr), capture_output=True)
        raise
    return name


@dataclass(frozen=True)
class Built:
    """One image: its tarball and its name, tagged by content (`dev-<image id>`), so a
    rebuilt image is a new tag and `helm upgrade` rolls the pods onto it."""

    tar: Path
    name: str

    @property
    def repository(self) -> str:
        return self.name.rsplit(":", 1)[0]

    @property
    def tag(self) -> str:
        return self.name.rsplit(":", 1)[1]


def build_image(component: str, base: str, out: Path, log: Path) -> Built:
    """`buildah bud` of Containerfile.<component> on `base`; `<out>/<component>.tar`."""
    argv = [
        "bud",
        "--isolation=chroot",
        "--layers",
        f"--file={REPO_ROOT / f'Containerfile.{component}'}",
        f"--build-arg=BASE_IMAGE={base}",
        f"--build-arg=VERSION={VERSION}",  # the image's `version` label (docs/release.md)
        f"--tag={image_name(component)}",
    ]
    if HOST_CA_BUNDLE.exists():
        argv += [
            f"--volume={HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro",
            f"--build-arg=PIP_CERT={HOST_CA_BUNDLE}",
        ]
    _run(f"buildah bud {component}", _buildah(*argv, str(REPO_ROOT)), log)
    image_id = _run("buildah inspect", _buildah("inspect", "--format={{.FromImageID}}",
                                                image_name(component)), log)  # fmt: skip
    name = f"{image_name(component).rsplit(':', 1)[0]}:{IMAGE_TAG}-{image_id[:12]}"
    _run(f"buildah tag {component}", _buildah("tag", image_name(component), name), log)
    tar = out / f"{component}.tar"
    tar.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    _run(f"buildah push {component}", _buildah("push", name, f"docker-archive:{tar}:{name}"), log)
    return Built(tar, name)


def build_images(out: Path, log: Path) -> dict[str, Built]:
    """Both images as tarballs under `out` (component -> what was built)."""
    _check_tools()
    base = ensure_base(log)
    return {c: build_image(c, base, out, log) for c in COMPONENTS}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hack.images", description=__doc__)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / ".dev" / "images")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    log = args.out / "build.log"
    try:
        built = build_images(args.out, log)
    except ImageError as e:
        print(f"make images: {e}", file=sys.stderr)
        return 1
    for b in built.values():
        print(f"  {b.name}  {b.tar}")
    print(f"images built in {time.monotonic() - t0:.1f}s (log {log})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
