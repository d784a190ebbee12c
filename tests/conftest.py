"""Hooks for every test: a test stopped by pytest-timeout reports where each asyncio task
waits, since the thread stacks pytest-timeout prints show only the event loop's select();
components run in the test's process log exceptions as plain tracebacks."""

from __future__ import annotations

import asyncio
import gc
import linecache
import shutil
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import structlog

from tests import workers


def _task_stack(task: asyncio.Task[object], limit: int = 12) -> str:
    """`task.print_stack`, less its one failure: a frame of a Cython coroutine (grpc.aio's
    server and calls) has no line number, which `print_stack` hands to linecache, which
    raises TypeError. Raised in this hook, that was an INTERNALERROR that ended the whole
    run: the timed-out test was never reported, and the tasks it left (grpc's) were torn down
    at interpreter shutdown, printing only "Error in sys.excepthook:" lines."""
    out = [f"--- {task.get_name()}: {task.get_coro()!r}"]
    for frame in task.get_stack(limit=limit):
        code, lineno = frame.f_code, frame.f_lineno
        out.append(f'  File "{code.co_filename}", line {lineno}, in {code.co_name}')
        line = linecache.getline(code.co_filename, lineno, frame.f_globals) if lineno else ""
        if line.strip():
            out.append(f"    {line.strip()}")
    return "\n".join(out) + "\n"


def _pending_task_stacks() -> str:
    # every loop's tasks (the test's loop is not running while the report is made), found
    # without asyncio's private registry; a timeout is rare enough for a walk of the heap
    tasks = [o for o in gc.get_objects() if isinstance(o, asyncio.Task) and not o.done()]
    return "".join(_task_stack(t) for t in sorted(tasks, key=lambda t: t.get_name())) or (
        "no pending tasks"
    )


@pytest.hookimpl(tryfirst=True)  # before the tmp_path plugin reads the basetemp
def pytest_configure(config: pytest.Config) -> None:
    """structlog's defaults, but a logged exception is a plain traceback. The default (rich,
    with every frame's locals: the allocator's whole state) rendered synchronously on the
    event loop of the in-process allocator or agent: one `log.exception` held it 3 s at
    load 4, longer than the integration allocator's 2.5 s renew deadline, and made a 30 s
    wait of test_bad_input take 13.8 s at load 8. The components' own processes configure
    their logs themselves (JSON); this only changes how tests render them."""
    workers.shorten_basetemp(config)
    renderer = structlog.get_config()["processors"][-1]
    if isinstance(renderer, structlog.dev.ConsoleRenderer):
        renderer.exception_formatter = structlog.dev.plain_traceback


# Tiers by folder (docs/style.md §12), and two cross-cutting kinds: `system` for runs of the
# whole cluster (every e2e test, the quick soak and latency runs), `realnode` for the real
# kubelet + containerd node. `pytest -m unit`, `-m "not system"`, `-m realnode` select them.
_TIERS = {"unit", "integration", "e2e", "packaging"}
_SYSTEM_MODULES = {"test_chaos_quick.py", "test_bench_latency_quick.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = workers.module_groups(items)
    for item in items:
        parts = item.path.parts
        tier = next((p for p in reversed(parts[:-1]) if p in _TIERS), None)
        if tier is not None:
            item.add_marker(tier)
        if tier == "e2e" or item.path.name in _SYSTEM_MODULES:
            item.add_marker("system")
        if groups[item.path] == workers.REALNODE_GROUP:
            item.add_marker("realnode")
    workers.write_groups(config, items, groups)


# `make test`'s pytest-xdist workers (tests/workers.py): the controller names a dir, each
# worker writes its tests' groups there, and `--dist loadgroup` schedules by them.
_GROUPS_DIR = pytest.StashKey[Path]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    config: pytest.Config = node.config
    if _GROUPS_DIR not in config.stash:
        config.stash[_GROUPS_DIR] = Path(tempfile.mkdtemp(prefix="instaslice-test-groups-"))
    node.workerinput[workers.GROUPS_KEY] = str(config.stash[_GROUPS_DIR])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup" or _GROUPS_DIR not in config.stash:
        return None  # xdist's own
    return workers.GroupScheduling(config, log, config.stash[_GROUPS_DIR])


def pytest_unconfigure(config: pytest.Config) -> None:
    if _GROUPS_DIR in config.stash:
        shutil.rmtree(config.stash[_GROUPS_DIR], ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and call.excinfo is not None and "Timeout" in str(call.excinfo.value):
        report.sections.append(("pending asyncio tasks", _pending_task_stacks()))
        _cancel_timed_out_test(item)
    return report


def _awaits(task: asyncio.Task[object], code: object) -> bool:
    """`task` runs (or awaits, however deep) a coroutine of the function `code`."""
    coro: object = task.get_coro()
    while coro is not None:
        if getattr(coro, "cr_code", None) is code:
            return True
        coro = getattr(coro, "cr_await", None)
    return False


def _cancel_timed_out_test(item: pytest.Item) -> None:
    """Cancel the timed-out test's own task and run its loop until the test's `finally`
    blocks and context managers are done. pytest-timeout's exception leaves the task pending;
    on the session loop (integration, e2e) it went on in the background during the next
    tests (its agents, allocators and gRPC servers still running) and was cancelled only when
    the loop closed at the end of the session, too late for grpc.aio's servers: torn down at
    interpreter exit, they printed only "Error in sys.excepthook:" lines."""
    code = getattr(getattr(item, "function", None), "__code__", None)
    if code is None:
        return
    tasks = [o for o in gc.get_objects() if isinstance(o, asyncio.Task) and not o.done()]
    for task in tasks:
        loop = task.get_loop()
        if _awaits(task, code) and not loop.is_closed() and not loop.is_running():
            task.cancel()
            loop.run_until_complete(asyncio.wait({task}, timeout=120))
