"""Test support shared by the integration and e2e tiers (no fixtures).

- `eventually(check)`: poll a condition under a deadline, its last truthy value returned.
  Tests may poll where nothing can be watched; the product never does (docs/style.md).
- `passes(count, more=n)`: until a component's pass counter has grown by `n`, before a test
  asserts that nothing happened (a sleep would prove nothing on a loaded machine).
- `wait_admission_sees_opt_in(kube, ns, probe)`: until admission treats namespace `ns` as
  opted in. The API server matches a webhook's namespaceSelector, and hands a
  ValidatingAdmissionPolicy its namespaceObject, from its own namespace cache, which may lag
  the opt-in label just written (seen in CI just after a reinstall: a pod created at once
  went through unmutated). Nothing watchable says when that cache caught up, so a dry-run
  create of `probe` (admission runs, nothing is stored) is tried until admission answers as
  for an opted-in namespace.
- `avoid_creates_in_flight()`: the allocator's `--avoid-creates-in-flight` for the whole
  run, from the environment variable `INSTASLICE_TEST_AVOID_CREATES_IN_FLIGHT` (unset: 0,
  the product's default). The allocator the integration tests start
  (tests/integration/allocator_fixtures.py) and the webhook/allocator process of the e2e
  systems (tests/e2e/conftest.py) run with it; a test that passes its own value keeps it.
  E.g. `INSTASLICE_TEST_AVOID_CREATES_IN_FLIGHT=2 pytest tests/integration/test_allocator.py`.
- `on_the_session_loop(items, folder)` and `log_tails(logs, lines)`: the conftest hooks of
  the two tiers (their async tests share the session's event loop; a failing test's report
  carries the tail of each log of the processes it ran against).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from common.kubeapi import ApiError, Kube, Obj, core_path

T = TypeVar("T")
AVOID_CREATES_ENV = "INSTASLICE_TEST_AVOID_CREATES_IN_FLIGHT"


def avoid_creates_in_flight() -> int:
    """The allocator's `--avoid-creates-in-flight` for this test run (module docstring)."""
    raw = os.environ.get(AVOID_CREATES_ENV, "").strip()
    try:
        value = int(raw or "0")
    except ValueError:
        value = -1
    if value < 0:
        raise pytest.UsageError(f"{AVOID_CREATES_ENV}={raw!r}: expected a whole number >= 0")
    return value


async def eventually(
    check: Callable[[], Awaitable[T | None]],
    *,
    within: float = 20.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll `check` until it returns something truthy; its last value is returned. An
    AssertionError raised by `check` counts as "not yet" and is reported on timeout."""
    deadline = time.monotonic() + within
    last: Any = None
    while True:
        try:
            last = await check()
        except AssertionError as exc:
            last = exc
        if last and not isinstance(last, AssertionError):
            return last  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}; last: {last!r}")
        await asyncio.sleep(interval)


async def passes(
    *counts: Callable[[], int],
    more: int,
    not_before: float = 0.0,
    within: float = 30.0,
    what: str = "passes",
) -> None:
    """Until each of `counts` (a component's passes: GC passes, reconcile rounds) has grown
    by `more`: whatever the component would do by then it has had its chance to do, so a
    test may assert that nothing happened. `not_before` (time.monotonic()): count only from
    then, for a threshold the component reads off the real clock that nothing injects."""
    if (wait := not_before - time.monotonic()) > 0:
        await asyncio.sleep(wait)  # real time for a threshold under test: nothing to wait on
    start = [count() for count in counts]

    async def grown() -> bool:
        return all(count() >= s + more for count, s in zip(counts, start, strict=True))

    await eventually(grown, within=within, interval=0.02, what=f"{more} more {what}")


async def wait_admission_sees_opt_in(
    kube: Kube,
    ns: str,
    probe: Obj,
    *,
    admitted: Callable[[Obj], bool] = lambda pod: True,
    refused_until: str | None = None,
    within: float = 30.0,
) -> Obj:
    """Dry-run `probe` in `ns` until admission answers as for an opted-in namespace: the pod
    it returns passes `admitted` (the webhook gated it, say), and a refusal whose message
    contains `refused_until` (a policy's "opted in" rule) means not yet; any other refusal
    fails at once. The pod admission returned last."""

    async def seen() -> Obj | None:
        try:
            pod = await kube.create(core_path("pods", ns), probe, dryRun="All")
        except ApiError as exc:
            if refused_until is None or refused_until not in exc.message:
                raise
            raise AssertionError(f"refused: {exc.message}") from None
        if not admitted(pod):
            raise AssertionError(f"admitted as for a namespace not opted in: {pod['spec']}")
        return pod

    return await eventually(seen, within=within, interval=0.2, what=f"namespace {ns} opted in")


def on_the_session_loop(items: list[pytest.Item], folder: Path) -> None:
    """Run every async test under `folder` in the session's event loop, the loop its
    session-scoped fixtures' clients live in (aiohttp sessions cannot cross loops)."""
    session_loop = pytest.mark.asyncio(loop_scope="session")
    for item in items:
        if folder in Path(str(item.path)).parents and item.get_closest_marker("asyncio"):
            item.add_marker(session_loop, append=False)  # closest marker wins


def log_tails(logs: Iterable[Path], lines: int) -> list[str]:
    """The last `lines` lines of each log, by name, each under a `--- name` header."""
    out = []
    for log in sorted(logs):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {log.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return out
