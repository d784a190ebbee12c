"""Hooks for every test: a test stopped by pytest-timeout reports where each asyncio task
waits, since the thread stacks pytest-timeout prints show only the event loop's select()."""

from __future__ import annotations

import asyncio
import gc
import io
from collections.abc import Generator

import pytest


def _pending_task_stacks() -> str:
    # every loop's tasks (the test's loop is not running while the report is made), found
    # without asyncio's private registry; a timeout is rare enough for a walk of the heap
    tasks = [o for o in gc.get_objects() if isinstance(o, asyncio.Task) and not o.done()]
    out = io.StringIO()
    for task in sorted(tasks, key=lambda t: t.get_name()):
        out.write(f"--- {task.get_name()}: {task.get_coro()!r}\n")
        task.print_stack(limit=12, file=out)
    return out.getvalue() or "no pending tasks"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and call.excinfo is not None and "Timeout" in str(call.excinfo.value):
        report.sections.append(("pending asyncio tasks", _pending_task_stacks()))
    return report
