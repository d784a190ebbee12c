"""`make release`'s Python entry (hack/release.py): the artifacts, their checksums, one version.

Covers: `python -m hack.release --out DIR` (what `make release` runs after `make images`)
writes exactly the chart package, the krew archive, the filled krew manifest and SHA256SUMS;
every line of SHA256SUMS is the file's sha256 (as `sha256sum -c` checks it); the packaged
chart's version and appVersion, its image tags, the krew manifest's version, URI and sha256,
and `version` of the archived plugin all say common/version.py's version; the archive carries
the LICENSE and runs in a virtualenv with nothing but the standard library (no PyPI, no
site-packages); building it twice gives the same bytes.
Leaves out: the images (`make images` needs a container engine) and pushing anything.
Needs the helm of `make kube-bins`.
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from common.version import VERSION

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def _images(where: Path) -> Path:
    """Stand-ins for `make images`' tarballs (their bytes are Buildah's business; the release
    copies them under its names and sums them)."""
    where.mkdir(parents=True, exist_ok=True)
    for component in ("webhook", "nodeagent"):
        (where / f"{component}.tar").write_bytes(f"image {component}".encode())
    return where


def _run_release(out: Path, images: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hack.release", "--out", str(out),
                           "--images", str(images)],
                          cwd=ROOT, capture_output=True, text=True, check=False)  # fmt: skip


def _release(out: Path) -> str:
    proc = _run_release(out, _images(out.parent / "images"))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _member(tar: tarfile.TarFile, name: str) -> bytes:
    f = tar.extractfile(name)
    assert f is not None, name
    return f.read()


def test_release_builds_the_artifacts_with_matching_checksums_and_one_version(
    tmp_path: Path,
) -> None:
    out = tmp_path / "release"
    stdout = _release(out)
    chart_tgz, archive = f"instaslice-{VERSION}.tgz", f"kubectl-instaslice-v{VERSION}.tar.gz"
    images = {f"instaslice-{c}-v{VERSION}.tar" for c in ("webhook", "nodeagent")}
    assert {p.name for p in out.iterdir()} == {chart_tgz, archive, "instaslice.yaml",
                                               "SHA256SUMS", *images}  # fmt: skip
    assert "Not pushed from here" in stdout
    assert (out / f"instaslice-webhook-v{VERSION}.tar").read_bytes() == b"image webhook"
    lines = [line.split("  ") for line in (out / "SHA256SUMS").read_text().splitlines()]
    sums = {name: digest for digest, name in lines}
    assert set(sums) == {chart_tgz, archive, "instaslice.yaml", *images}
    for name, digest in sums.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True,
                           text=True, check=False)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr

    with tarfile.open(out / chart_tgz) as tar:
        chart = yaml.safe_load(_member(tar, "instaslice/Chart.yaml"))
        values = yaml.safe_load(_member(tar, "instaslice/values.yaml"))
    assert (chart["version"], chart["appVersion"]) == (VERSION, f"v{VERSION}")
    assert {i["tag"] for i in values["images"].values()} == {f"v{VERSION}"}

    manifest = yaml.safe_load((out / "instaslice.yaml").read_text())
    assert manifest["spec"]["version"] == f"v{VERSION}"
    (platform,) = manifest["spec"]["platforms"]
    assert platform["sha256"] == sums[archive]
    assert platform["uri"].endswith(f"/v{VERSION}/{archive}")

    # the same bytes again: the checksum published is the checksum of what anyone rebuilds
    again = tmp_path / "again"
    _release(again)
    assert (again / archive).read_bytes() == (out / archive).read_bytes()


def test_a_release_without_the_images_says_to_build_them(tmp_path: Path) -> None:
    proc = _run_release(tmp_path / "release", tmp_path / "no-images")
    assert proc.returncode != 0
    assert "nodeagent.tar is missing" in proc.stderr or "webhook.tar is missing" in proc.stderr
    assert "make images" in proc.stderr


def test_the_krew_archive_runs_with_the_standard_library_alone(tmp_path: Path) -> None:
    from hack.krew_archive import build

    path, _ = build(tmp_path / "dist")
    unpacked = tmp_path / "krew"
    with tarfile.open(path) as tar:
        names = set(tar.getnames())
        assert "Apache License" in _member(tar, "LICENSE").decode()
        assert {"kubectl-instaslice", "licenses/PyYAML-LICENSE", "lib/yaml/__init__.py",
                "lib/common/kubectl_plugin.py",
                "lib/common/catalog/models.json"} <= names  # fmt: skip
        assert not any(n.endswith((".so", ".whl", ".pyc")) for n in names)
        tar.extractall(unpacked, filter="data")
    bare = tmp_path / "bare"  # python3 with its standard library and nothing else
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    py = bare / "bin" / "python"
    probe = subprocess.run([str(py), "-c", "import yaml"], capture_output=True, check=False)
    assert probe.returncode != 0  # PyYAML comes only from the archive
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PIP_NO_INDEX": "1"}

    def plugin(*args: str) -> str:
        proc = subprocess.run([str(py), str(unpacked / "kubectl-instaslice"), *args],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert plugin("version", "--client").startswith(f"Plugin Version: v{VERSION}")
    flavors = [d for d in yaml.safe_load_all(io.StringIO(plugin("kueue-config")))][1:]
    assert flavors and all(f["kind"] == "ResourceFlavor" for f in flavors)
    assert "usage: kubectl instaslice" in plugin("--help")
