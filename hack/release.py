"""`make release`: the files of a release, built here and ready to push (docs/release.md).

Into one directory (default .dev/release/, emptied first): the Helm chart package
(`helm package charts/instaslice`, instaslice-<version>.tgz), the krew archive
(hack/krew_archive.py) and the krew manifest with that archive's URI and sha256 filled in (for
the krew index), both images as docker-archive tarballs (`instaslice-<component>-v<version>.tar`,
copied from what `make images` wrote to .dev/images/: the Makefile's `release` target runs it
first), and SHA256SUMS over all of them in `sha256sum -c` format. Every version comes from
common/version.py; this refuses to run when the committed chart says another one. Pushing the
images, the chart and the GitHub release needs credentials and a network this step does not
have, and is left to the person releasing.

Usage: python -m hack.release [--out DIR] [--base-uri URI] [--images DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from common.version import VERSION
from hack import krew_archive
from hack.cluster.bins import REPO_ROOT, find_helm

CHART = REPO_ROOT / "charts" / "instaslice"
KREW_MANIFEST = REPO_ROOT / "plugins" / "krew" / "instaslice.yaml"
BASE_URI = "https://github.com/instaslice/instaslice/releases/download/v{version}"
SUMS = "SHA256SUMS"
IMAGES = REPO_ROOT / ".dev" / "images"  # where `make images` (hack/images.py) writes them
COMPONENTS = ("webhook", "nodeagent")


class ReleaseError(RuntimeError):
    """Something the release needs is missing; the message says what to run."""


def copy_images(images: Path, out: Path) -> None:
    """Both images' tarballs from `images` into `out`, named for the release."""
    for component in COMPONENTS:
        tar = images / f"{component}.tar"
        if not tar.is_file():
            raise ReleaseError(f"{tar} is missing: run `make images` first (or `make release`)")
        shutil.copyfile(tar, out / f"instaslice-{component}-v{VERSION}.tar")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def krew_manifest(uri: str, sha: str, version: str = VERSION) -> str:
    """plugins/krew/instaslice.yaml with this release's version, archive URI and sha256."""
    text = KREW_MANIFEST.read_text()
    text = re.sub(r"(?m)^(  version: ).*$", rf"\g<1>v{version}", text)
    text = re.sub(r"(?m)^(      uri: ).*$", rf"\g<1>{uri}", text)
    return re.sub(r"(?m)^(      sha256: ).*$", rf'\g<1>"{sha}"', text)


def package_chart(helm: Path, out: Path) -> Path:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    if (chart["version"], chart["appVersion"]) != (VERSION, f"v{VERSION}"):
        raise SystemExit(
            f"charts/instaslice is at {chart['version']}/{chart['appVersion']}, "
            f"common/version.py at {VERSION}: run `make chart` and commit"
        )
    subprocess.run([str(helm), "package", str(CHART), "--destination", str(out)],
                   check=True, capture_output=True, text=True)  # fmt: skip
    path = out / f"instaslice-{VERSION}.tgz"
    if not path.is_file():
        raise SystemExit(f"helm package wrote no {path.name} into {out}")
    return path


def release(
    out: Path, helm: Path, base_uri: str = BASE_URI, images: Path = IMAGES
) -> dict[str, str]:
    """Build every artifact into `out`; returns file name -> sha256 (what SHA256SUMS lists)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    copy_images(images, out)
    package_chart(helm, out)
    archive, sha = krew_archive.build(out)
    uri = f"{base_uri.format(version=VERSION)}/{archive.name}"
    (out / "instaslice.yaml").write_text(krew_manifest(uri, sha))
    sums = {p.name: sha256(p) for p in sorted(out.iterdir()) if p.name != SUMS}
    (out / SUMS).write_text("".join(f"{s}  {name}\n" for name, s in sums.items()))
    return sums


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT / ".dev" / "release")
    p.add_argument("--base-uri", default=BASE_URI, help="where the archive will be published")
    p.add_argument("--images", type=Path, default=IMAGES, help="where `make images` wrote them")
    args = p.parse_args()
    try:
        sums = release(args.out, find_helm(), args.base_uri, args.images)
    except ReleaseError as exc:
        raise SystemExit(f"release: {exc}") from None
    for name, s in sums.items():
        print(f"{s}  {args.out / name}")
    print(
        f"release v{VERSION} ready in {args.out}. Not pushed from here: push the images "
        "(make images), upload these files to the GitHub release, tag, and submit "
        "instaslice.yaml to the krew index (docs/release.md)."
    )


if __name__ == "__main__":
    main()
