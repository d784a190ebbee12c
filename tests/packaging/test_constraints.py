"""The images' dependency versions are pinned (constraints.txt), so a rebuild never picks up a
new version silently (common/kubeapi.py relies on kubernetes-asyncio's internals).

Checks: constraints.txt pins, with `==`, every distribution instaslice[server] needs (the
closure of its requirements, read from the installed metadata of this environment) and the
tools that install it (pip; setuptools for the wheel's build); the test environment runs the
pinned versions (make install installs with the same constraints), so the tests test what the
images ship; both Containerfiles install with it, for the dependencies and for the wheel's
isolated build. Leaves out: building the images (make images; tests/e2e/test_installed.py
runs them and compares what they hold with this file).
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def pins(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version and re.fullmatch(r"[\w.+!-]+", version), f"not an exact pin: {line}"
        out[canonicalize_name(name)] = version
    return out


def closure(root: str, extras: set[str]) -> set[str]:
    """The distributions `root[extras]` needs, transitively, in this environment."""
    seen: set[str] = set()
    todo = [(root, extras)]
    while todo:
        name, want = todo.pop()
        for req in metadata.requires(name) or []:
            r = Requirement(req)
            env = {"extra": ""}
            if r.marker is not None and not any(
                r.marker.evaluate({**env, "extra": e}) for e in (want or {""})
            ):
                continue
            key = canonicalize_name(r.name)
            if key not in seen:
                seen.add(key)
                todo.append((r.name, set(r.extras)))
    return seen


CONSTRAINTS = pins((ROOT / "constraints.txt").read_text())


def test_every_dependency_of_the_server_extra_is_pinned() -> None:
    needed = closure("instaslice", {"server"}) | {"pip", "setuptools"}
    missing = sorted(needed - CONSTRAINTS.keys())
    assert not missing, f"constraints.txt does not pin {missing}"


@pytest.mark.parametrize("name", sorted(closure("instaslice", {"server"})))
def test_the_tests_run_the_pinned_version(name: str) -> None:
    assert metadata.version(name) == CONSTRAINTS[name], (
        f"{name}: {metadata.version(name)} here, {CONSTRAINTS[name]} in the images; "
        "`make install` installs with constraints.txt"
    )


@pytest.mark.parametrize("component", ["webhook", "nodeagent"])
def test_the_containerfiles_install_with_the_constraints(component: str) -> None:
    text = (ROOT / f"Containerfile.{component}").read_text()
    assert "COPY constraints.txt /src/" in text
    assert "pip install --no-cache-dir -r /src/constraints.txt" in text
    assert "PIP_CONSTRAINT=/src/constraints.txt /opt/instaslice/bin/pip wheel" in text
    assert re.search(
        r"pip install --no-cache-dir -c /src/constraints.txt \\\n\s+\"\$\(ls /wheels", text
    )
    # no other pip install without the constraints
    installs = re.findall(r"pip install[^\n]*", text)
    assert all("constraints.txt" in line for line in installs), installs
