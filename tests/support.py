"""Test support shared by the integration and e2e tiers (no fixtures).

- `eventually(check)`: poll a condition under a deadline, its last truthy value returned.
  Tests may poll where nothing can be watched; the product never does (docs/style.md).
- `passes(count, more=n)`: until a component's pass counter has grown by `n`, before a test
  asserts that nothing happened (a sleep would prove nothing on a loaded machine).
- `wait_for(kube, path, check)`: list, then watch `path` until `check(objects)` answers;
  the one wait on the API server of both tiers (watches, not polling).
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
import contextlib
import json
import os
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest

from common.kubeapi import ApiError, Kube, Obj, core_path, obj_key

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


async def wait_for(
    kube: Kube,
    path: str,
    check: Callable[[dict[str, Obj]], T | None],
    *,
    what: str = "",
    within: float = 60.0,
    **query: Any,
) -> T:
    """List `path` (with `query`: labelSelector, fieldSelector), then watch it; the first
    `check(objects)` that is neither None nor False (an empty list is an answer). The objects
    are keyed by name within one namespace's path, by `namespace/name` across namespaces
    (cluster-scoped ones by name). A dropped or expired watch is re-listed; 429 (a new CRD's
    storage still initializing, on a loaded machine) is retried. Fails with `what` and a
    summary of the last objects seen on timeout."""
    if unknown := set(query) - {"labelSelector", "fieldSelector"}:  # e.g. a timeout misspelled
        raise TypeError(f"wait_for: {sorted(unknown)} are not selectors (the wait is `within`)")
    within_ns = "/namespaces/" in path
    objs: dict[str, Obj] = {}

    def key(o: Obj) -> str:
        return str(o["metadata"]["name"]) if within_ns else obj_key(o)

    async def run() -> T:
        while True:
            try:
                listing = await kube.list(path, **query)
            except ApiError as exc:
                if exc.status != 429:
                    raise
                await asyncio.sleep(0.2)
                continue
            objs.clear()
            objs.update({key(o): o for o in listing.get("items", [])})
            if (got := check(objs)) is not None and got is not False:
                return got
            rv = str(listing.get("metadata", {}).get("resourceVersion", ""))
            remaining = max(1, int(deadline - time.monotonic()) + 1)
            events = cast(
                AsyncGenerator[tuple[str, Obj], None],
                kube.watch(path, rv, timeout_s=remaining, **query),
            )
            # aclosing: returning mid-stream must release the connection now, not at GC
            with contextlib.suppress(ApiError):
                async with contextlib.aclosing(events):
                    async for etype, obj in events:
                        if etype == "BOOKMARK":
                            continue
                        if etype == "DELETED":
                            objs.pop(key(obj), None)
                        else:
                            objs[key(obj)] = obj
                        if (got := check(objs)) is not None and got is not False:
                            return got

    deadline = time.monotonic() + within
    try:
        async with asyncio.timeout(within):
            return await run()
    except TimeoutError:
        seen = json.dumps(_summaries(objs), indent=1)[:4000]
        raise AssertionError(
            f"timed out after {within:.0f}s waiting for {what or path}; last seen:\n{seen}"
        ) from None


def listed(predicate: Callable[[list[Obj]], T | None]) -> Callable[[dict[str, Obj]], T | None]:
    """`predicate` over the objects as a list, as `wait_for`'s check."""
    return lambda objs: predicate(list(objs.values()))


def _summaries(objs: Mapping[str, Obj]) -> dict[str, Any]:
    """What a failure message shows of each object: phase, gates, node, conditions."""
    out: dict[str, Any] = {}
    for name, o in objs.items():
        spec, status = o.get("spec", {}), o.get("status", {})
        out[name] = {
            "phase": status.get("phase"),
            "node": spec.get("nodeName"),
            "gates": spec.get("schedulingGates"),
            "message": status.get("message"),
            "conditions": [
                {k: c.get(k) for k in ("type", "status", "reason", "message")}
                for c in status.get("conditions", [])
            ],
            "deleting": "deletionTimestamp" in o.get("metadata", {}),
        }
    return out


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
