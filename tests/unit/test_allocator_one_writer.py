"""Every API write of the allocator goes through one `writes.Writes` (docs/allocator.md).

Covers: no module of webhook/allocator/ but writes.py calls a write of `Kube` (leader.py
writes only its own Lease, which no Lease check can guard), none but the controller builds
a `Writes`, the controller hands its one `Writes` to every part that writes, and the alias
of an event written in the background (`Tell`) is declared there once. Leaves out
what each write sends (test_allocator_controller.py, the integration tests).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import cast

import pytest

from common.kubeapi import Kube
from testkit.clock import FakeClock
from webhook.allocator import AllocatorMetrics, AllocatorSettings, Controller
from webhook.allocator.leader import LeaderElector

ALLOCATOR = Path(__file__).resolve().parents[2] / "webhook" / "allocator"
KUBE_WRITES = {"create", "replace", "patch", "delete", "delete_ignore_missing"}


def _calls(path: Path) -> list[tuple[int, str]]:
    """(line, what) for each call of a Kube write (what: the method) and each `Writes`
    built (what: "Writes") in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in KUBE_WRITES:
            receiver = ast.unparse(func.value)
            if "kube" in receiver.lower():
                out.append((node.lineno, func.attr))
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if name == "Writes":
            out.append((node.lineno, "Writes"))
    return out


def test_only_writes_py_writes_and_only_the_controller_builds_it() -> None:
    allowed = {
        "writes.py": KUBE_WRITES,
        "leader.py": {"create", "replace"},  # its own Lease only
        "controller.py": {"Writes"},  # the one Writes, handed on
    }
    found = {}
    for path in sorted(ALLOCATOR.glob("*.py")):
        calls = [(line, w) for line, w in _calls(path) if w not in allowed.get(path.name, set())]
        if calls:
            found[path.name] = calls
    assert found == {}


class _Leader:
    is_leader = True

    def check(self) -> None:
        pass


@pytest.mark.parametrize("scale_up", ["off", "placeholder"])
async def test_the_controller_hands_its_one_writes_to_every_writer(scale_up: str) -> None:
    from webhook.allocator.autoscale import ScaleUpSettings, SignalMode

    settings = AllocatorSettings(
        namespace="instaslice-system",
        identity="test",
        clock=FakeClock(),
        scale_up=ScaleUpSettings(mode=SignalMode(scale_up)),
    )
    c = Controller(
        cast(Kube, object()), cast(LeaderElector, _Leader()), AllocatorMetrics(), settings
    )
    writers = [c.steps.writes, c.modes.writes, c.loops.writes, c.scale_up.writes]
    assert all(w is c.writes for w in writers)


def test_the_event_writing_alias_is_defined_once_in_writes_py() -> None:
    """`Tell` and `EventType_` (an event written in the background, and its type) are
    declared in writes.py only; the other modules import them."""
    found = []
    for path in sorted(ALLOCATOR.glob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            found += [(path.name, n) for n in sorted(names & {"Tell", "EventType_"})]
    assert found == [("writes.py", "EventType_"), ("writes.py", "Tell")]
