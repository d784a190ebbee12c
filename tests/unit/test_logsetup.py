"""The daemons' logging: JSON lines on stderr, and the level changed at run time by signal.

Covers: the stream (stderr, never stdout); one step more verbose per SIGUSR1, back to the
start level on SIGUSR2, each change logged; loggers cached before the change obey it; both
entry points (`instaslice-webhook`, `instaslice-nodeagent`) install the handlers — their real
`main()` runs with the server loop replaced by a step that signals its own process.
Leaves out: the daemons' own work (their modules' tests).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from common.logsetup import LEVELS, LogLevel, configure_logging, more_verbose


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@pytest.fixture
def _signals_ignored_unless_handled() -> Iterator[None]:
    """SIGUSR1/2 kill a process that handles neither: an entry point that installs no handler
    must fail its test (the change never comes), not end the test run."""
    before = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.mark.parametrize(
    ("level", "after"),
    [("error", "warning"), ("warning", "info"), ("info", "debug"), ("debug", "debug")],
)
def test_sigusr1_is_one_step_more_verbose(level: str, after: str) -> None:
    assert more_verbose(level) == after


def test_logs_go_to_stderr_as_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", stream=None)
    structlog.get_logger("t").info("hello", n=1)
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = [json.loads(x) for x in err.splitlines()]
    assert line["event"] == "hello" and line["level"] == "info" and line["n"] == 1


def test_a_cached_logger_obeys_a_level_change() -> None:
    stream = io.StringIO()
    levels = configure_logging("warning", stream=stream)
    log = structlog.get_logger("t")
    log.info("dropped")  # cached now, at warning
    levels.set(more_verbose(levels.current), "test")
    log.info("kept")
    levels.set(levels.initial, "test")
    log.info("dropped again")
    log.warning("still kept")
    events = [(x["event"], x["level"]) for x in _lines(stream)]
    assert events == [
        ("log level changed", "info"),
        ("kept", "info"),
        ("log level changed", "warning"),
        ("still kept", "warning"),
    ]
    assert levels.current == "warning"


def test_an_unknown_level_is_refused() -> None:
    with pytest.raises(ValueError, match="one of debug, info, warning, error"):
        configure_logging("verbose")
    assert LEVELS == ("debug", "info", "warning", "error")


class _Steps:
    """Stands in for a daemon's server loop: signal this process, record the level after
    each change (the entry point's LogLevel reports changes through `on_change`)."""

    def __init__(self) -> None:
        self.changed = asyncio.Event()
        self.debug_seen: list[bool] = []

    def configure(self, level: str) -> LogLevel:
        levels = configure_logging(level)
        levels.on_change = lambda _: self.changed.set()
        return levels

    async def run(self, settings: object) -> None:
        log = structlog.get_logger("t")
        self.debug_seen.append(bool(log.is_enabled_for(logging.DEBUG)))
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            self.changed.clear()
            os.kill(os.getpid(), sig)
            await asyncio.wait_for(self.changed.wait(), 5)
            self.debug_seen.append(bool(log.is_enabled_for(logging.DEBUG)))


@pytest.mark.usefixtures("_signals_ignored_unless_handled")
def test_the_webhook_changes_its_level_on_sigusr1_and_back_on_sigusr2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import webhook.main

    steps = _Steps()
    monkeypatch.setattr(webhook.main, "configure_logging", steps.configure)
    monkeypatch.setattr(webhook.main, "run", steps.run)
    assert webhook.main.main(["--log-level", "info"]) == 0
    assert steps.debug_seen == [False, True, False]
    _, err = capsys.readouterr()
    whys = [
        x.get("why") for x in map(json.loads, err.splitlines()) if x["event"] == "log level changed"
    ]
    assert whys == ["SIGUSR1", "SIGUSR2"]


@pytest.mark.usefixtures("_signals_ignored_unless_handled")
def test_the_node_agent_changes_its_level_on_sigusr1_and_back_on_sigusr2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import nodeagent.main

    steps = _Steps()
    monkeypatch.setattr(nodeagent.main, "configure_logging", steps.configure)
    monkeypatch.setattr(nodeagent.main, "serve", steps.run)
    assert nodeagent.main.main(["--nodes", "n0", "--log-level", "info"]) == 0
    assert steps.debug_seen == [False, True, False]
    out, err = capsys.readouterr()
    assert out == ""  # stdout stays for --discover-only's report
    assert any(json.loads(x)["event"] == "log level changed" for x in err.splitlines())
