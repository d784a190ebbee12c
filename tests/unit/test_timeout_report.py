"""tests/conftest.py on a test stopped by pytest-timeout (a child pytest run with the
conftest as its plugin, on the session's event loop as integration and e2e tests run):

- the test is failed and named, with where each pending asyncio task waits, also when a task
  is a Cython coroutine (a running grpc.aio server's, whose frames have no line number).
  Listing such a task raised in the report hook: an INTERNALERROR that ended the whole run
  without naming the test;
- its own task is cancelled and its cleanup done before the next test starts. It was left
  pending, running on in the background during later tests, and its gRPC servers were torn
  down at interpreter exit, printing only "Error in sys.excepthook:" lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SUITE = """
import asyncio
import grpc
import pytest

session_loop = pytest.mark.asyncio(loop_scope="session")
CLEANED = []

@session_loop
@pytest.mark.timeout(3)
async def test_waits_past_its_timeout(tmp_path):
    server = grpc.aio.server()
    server.add_insecure_port(f"unix://{tmp_path}/s.sock")
    await server.start()
    try:
        await asyncio.sleep(60)
    finally:
        await server.stop(0)
        CLEANED.append(True)

@session_loop
async def test_the_next_test_starts_after_that_cleanup():
    assert CLEANED
"""


def test_a_timed_out_test_is_reported_and_cleaned_up_before_the_next(tmp_path: Path) -> None:
    suite = tmp_path / "test_slow.py"
    suite.write_text(SUITE)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "-c", "/dev/null", f"--rootdir={tmp_path}", "-o", "asyncio_mode=auto",
         f"--basetemp={tmp_path / 'tmp'}", str(suite)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "INTERNALERROR" not in out, out
    assert proc.returncode == 1, out
    assert "FAILED" in out and "test_waits_past_its_timeout" in out, out
    assert "pending asyncio tasks" in out and "server.pyx.pxi" in out, out  # grpc's frames
    assert "1 failed, 1 passed" in out, out
    assert "Error in sys.excepthook" not in out, out
