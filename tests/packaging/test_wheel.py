"""What we ship installs and runs outside this source tree.

Builds the wheel the way the Containerfiles do — from a build context holding exactly what
their `COPY` lines copy, `pip wheel --no-deps` — installs it into a fresh virtualenv in a
temporary directory (not the source tree, not `.venv/`'s editable install), then, with that
virtualenv's interpreter in isolated mode and the working directory elsewhere: imports every
module of `common`, `webhook` and `nodeagent` (each must load from the virtualenv; the set must
equal the source tree's), loads the packaged model catalog, and runs every console script of
pyproject.toml with `--help`, plus `instaslice-emu lgip` (package data).

The wheel's third-party dependencies are not downloaded: the fresh virtualenv sees `.venv/`'s
site-packages through a `.pth` path line (path lines do not run `.venv/`'s own `.pth` hooks,
so its editable install of this project stays invisible — the test checks where each module
came from). Also checks that the committed kubelet gRPC stubs are what the vendored protos
generate, and that the dependency floors in pyproject.toml satisfy the stubs' version checks.
Leaves out: building images (no container engine here) and installing from an index.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "webhook", "nodeagent")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = sorted(PYPROJECT["project"]["scripts"])
GEN = ROOT / "nodeagent" / "deviceplugin" / "_gen"

pytestmark = pytest.mark.timeout(600)


def _run(*cmd: str | Path, cwd: Path) -> str:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}: rc {proc.returncode}\n{proc.stderr}"
    return proc.stdout


def containerfile_sources(component: str) -> list[str]:
    """The repo paths a Containerfile's build stage copies into /src."""
    text = (ROOT / f"Containerfile.{component}").read_text()
    out = []
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        *sources, dest = line.split()
        assert dest.startswith("/src"), line
        out += sources
    return out


def source_modules() -> set[str]:
    mods = set()
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return mods


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("packaging")
    context = work / "src"
    context.mkdir()
    copied = set(containerfile_sources("webhook"))
    assert copied == set(containerfile_sources("nodeagent")), "the images install one wheel"
    for src in copied:
        path = ROOT / src
        if path.is_dir():
            shutil.copytree(
                path, context / src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(path, context / src)
    dist = work / "dist"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", dist, context, cwd=work)  # fmt: skip
    (wheel,) = dist.glob("instaslice-*.whl")
    env = work / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", env, cwd=work)
    py = env / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", wheel,
         cwd=work)  # fmt: skip
    purelib = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                        cwd=work).strip())  # fmt: skip
    (purelib / "zz_dev_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    yield env


_IMPORT_ALL = """
import importlib, json, pkgutil, sys
from pathlib import Path
out = {}
for name in sys.argv[1:]:
    pkg = importlib.import_module(name)
    out[name] = pkg.__file__
    for m in pkgutil.walk_packages(pkg.__path__, name + "."):
        out[m.name] = importlib.import_module(m.name).__file__
from common.catalog import load_catalog
out["catalog-models"] = sorted(m.name for m in load_catalog().models)
print(json.dumps(out))
"""


def test_every_module_imports_from_the_installed_wheel(venv: Path, tmp_path: Path) -> None:
    found = json.loads(
        _run(venv / "bin" / "python", "-I", "-c", _IMPORT_ALL, *PACKAGES, cwd=tmp_path)
    )
    models = found.pop("catalog-models")
    assert "H200-141GB" in models
    for name, file in found.items():
        assert Path(file).resolve().is_relative_to(venv.resolve()), f"{name} from {file}"
    assert set(found) == source_modules()
    assert "nodeagent.deviceplugin.plugin" in found  # the lazily imported device-plugin mode


@pytest.mark.parametrize("script", SCRIPTS)
def test_console_script_help(venv: Path, tmp_path: Path, script: str) -> None:
    out = _run(venv / "bin" / script, "--help", cwd=tmp_path)
    assert "usage:" in out


def test_emulator_cli_reads_packaged_data(venv: Path, tmp_path: Path) -> None:
    out = _run(venv / "bin" / "instaslice-emu", "lgip", "--model", "H200-141GB", cwd=tmp_path)
    assert "MIG 1g.18gb" in out


def test_wheel_carries_the_license(venv: Path) -> None:
    licenses = list(venv.glob("lib/python*/site-packages/instaslice-*.dist-info/**/LICENSE"))
    assert licenses and "Apache License" in licenses[0].read_text()


# --- the committed kubelet gRPC stubs ------------------------------------------------------------


def test_committed_stubs_are_what_the_vendored_protos_generate(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    _run(ROOT / "hack" / "gen-protos.sh", out, cwd=ROOT)
    generated = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    committed = {
        p.relative_to(GEN): p.read_bytes()
        for p in GEN.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert generated.keys() == committed.keys()
    stale = [str(p) for p in generated if generated[p] != committed[p]]
    assert not stale, f"run `make protos` and commit: {stale}"
    assert (ROOT / "third_party" / "k8s.io" / "kubelet" / "LICENSE").is_file()


def _floor(dep: str) -> tuple[int, ...]:
    deps = (
        PYPROJECT["project"]["dependencies"]
        + PYPROJECT["project"]["optional-dependencies"]["server"]
    )
    (spec,) = [d for d in deps if re.match(rf"{dep}\b", d)]
    m = re.search(r">=\s*([\d.]+)", spec)
    assert m, spec
    return tuple(int(x) for x in m.group(1).split("."))


def test_dependency_floors_satisfy_the_stubs_version_checks() -> None:
    """The stubs refuse to import under an older grpcio/protobuf than generated them."""
    for grpc_file in GEN.rglob("api_pb2_grpc.py"):
        m = re.search(r"^GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_file.read_text(), re.M)
        assert m, grpc_file
        assert _floor("grpcio") >= tuple(int(x) for x in m.group(1).split("."))
    for pb_file in GEN.rglob("api_pb2.py"):
        m = re.search(r"Protobuf Python Version: ([\d.]+)", pb_file.read_text())
        assert m, pb_file
        assert _floor("protobuf") >= tuple(int(x) for x in m.group(1).split("."))


# --- the kubectl plugin without the server's dependencies -----------------------------------------

SERVER_ONLY = ("grpc", "pynvml", "prometheus_client", "jsonpatch", "cryptography", "google")
_PLUGIN_ALONE = f"""
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {SERVER_ONLY!r}:
            raise ModuleNotFoundError(f"{{name}} is not installed")
sys.meta_path.insert(0, Absent())
from common.kubectl_plugin import main
sys.exit(main(sys.argv[1:]))
"""


def test_kubectl_plugin_needs_only_the_base_dependencies(venv: Path, tmp_path: Path) -> None:
    """`pip install instaslice` (krew) brings no grpcio, NVML, Prometheus or crypto library,
    and the plugin runs without them; the images ask for instaslice[server]."""
    base = {re.split(r"[<>=\[ ]", d)[0].lower() for d in PYPROJECT["project"]["dependencies"]}
    assert base.isdisjoint({"grpcio", "protobuf", "nvidia-ml-py", "prometheus-client",
                            "jsonpatch", "cryptography"}), base  # fmt: skip
    out = _run(venv / "bin" / "python", "-I", "-c", _PLUGIN_ALONE, "--help", cwd=tmp_path)
    assert "gather" in out
    for component in ("webhook", "nodeagent"):
        assert "[server]" in (ROOT / f"Containerfile.{component}").read_text()


# --- the daemons without the server's dependencies ------------------------------------------------

_DAEMON_ALONE = f"""
import importlib, importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {SERVER_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent())
module, function = sys.argv[1].split(":")
sys.argv = [sys.argv[2], "--help"]
sys.exit(getattr(importlib.import_module(module), function)())
"""


@pytest.mark.parametrize("script", ["instaslice-webhook", "instaslice-nodeagent", "instaslice-emu"])
def test_a_daemon_without_the_server_extra_says_which_extra_to_install(
    venv: Path, tmp_path: Path, script: str
) -> None:
    """`pip install instaslice` without `[server]`: the console script's own entry point (as
    pyproject.toml names it) exits 1 with one line naming the extra, not a traceback."""
    entry = PYPROJECT["project"]["scripts"][script]
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-I", "-c", _DAEMON_ALONE, entry, script],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"{script}: " in proc.stderr and "pip install 'instaslice[server]'" in proc.stderr


def test_the_extras_module_knows_every_server_dependency() -> None:
    from common.extras import SERVER_MODULES

    server = {re.split(r"[<>=\[ ]", d)[0].lower() for d in
              PYPROJECT["project"]["optional-dependencies"]["server"]}  # fmt: skip
    assert set(SERVER_MODULES.values()) == server
