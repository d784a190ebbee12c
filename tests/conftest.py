"""Hooks for every test: a test stopped by pytest-timeout reports where each asyncio task
waits, since the thread stacks pytest-timeout prints show only the event loop's select();
components run in the test's process log exceptions as plain tracebacks."""

from __future__ import annotations

import asyncio
import gc
import io
from collections.abc import Generator

import pytest
import structlog


def _pending_task_stacks() -> str:
    # every loop's tasks (the test's loop is not running while the report is made), found
    # without asyncio's private registry; a timeout is rare enough for a walk of the heap
    tasks = [o for o in gc.get_objects() if isinstance(o, asyncio.Task) and not o.done()]
    out = io.StringIO()
    for task in sorted(tasks, key=lambda t: t.get_name()):
        out.write(f"--- {task.get_name()}: {task.get_coro()!r}\n")
        task.print_stack(limit=12, file=out)
    return out.getvalue() or "no pending tasks"


def pytest_configure(config: pytest.Config) -> None:
    """structlog's defaults, but a logged exception is a plain traceback. The default (rich,
    with every frame's locals: the allocator's whole state) rendered synchronously on the
    event loop of the in-process allocator or agent: one `log.exception` held it 3 s at
    load 4, longer than the integration allocator's 2.5 s renew deadline, and made a 30 s
    wait of test_bad_input take 13.8 s at load 8. The components' own processes configure
    their logs themselves (JSON); this only changes how tests render them."""
    renderer = structlog.get_config()["processors"][-1]
    if isinstance(renderer, structlog.dev.ConsoleRenderer):
        renderer.exception_formatter = structlog.dev.plain_traceback


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and call.excinfo is not None and "Timeout" in str(call.excinfo.value):
        report.sections.append(("pending asyncio tasks", _pending_task_stacks()))
    return report
