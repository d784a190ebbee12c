"""Logging of the two daemons: structlog JSON lines on stderr, the level changeable at run time.

Why stderr: Kubernetes' own components (klog) and the controller-runtime operators an OpenShift
admin already runs beside InstaSlice (GPU Operator, Kueue) log there; `oc logs`/`kubectl logs`
and OpenShift's log collector read both streams alike, and stdout stays for what a command
prints (`instaslice-nodeagent --discover-only`, which `kubectl instaslice gather` runs through
`kubectl exec`, and whose output must not be mixed with log lines).

The level at run time, with no restart (docs/configuration.md "Logging"): SIGUSR1 makes the
log one step more verbose (error → warning → info → debug), SIGUSR2 returns to the
`--log-level` the process started with; each change is logged at its new level. Loggers are
cached on first use (a hot path pays no lookup), so the level lives in one wrapper class whose
level methods are swapped in place: every logger, cached or not, obeys the new level at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error")  # most verbose first


def level_number(name: str) -> int:
    """`--log-level`'s value as a logging number; ValueError for anything else."""
    if name.lower() not in LEVELS:
        raise ValueError(f"log level {name!r}: one of {', '.join(LEVELS)}")
    return logging.getLevelNamesMapping()[name.upper()]


def more_verbose(level: str) -> str:
    """One step towards debug (debug stays debug)."""
    return LEVELS[max(0, LEVELS.index(level) - 1)]


def _level_methods(level: str) -> dict[str, Any]:
    made = structlog.make_filtering_bound_logger(level_number(level))
    return {k: v for k, v in vars(made).items() if not k.startswith("__")}


@dataclass
class LogLevel:
    """The process's log level: where it started, where it is, and the switch between them."""

    initial: str
    wrapper: type[Any]
    current: str = ""
    on_change: Callable[[str], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.current = self.current or self.initial

    def set(self, level: str, why: str) -> None:
        previous, self.current = self.current, level
        for name, method in _level_methods(level).items():
            setattr(self.wrapper, name, method)
        log = structlog.get_logger("logging")
        getattr(log, level)("log level changed", previous=previous, level_now=level, why=why)
        if self.on_change is not None:
            self.on_change(level)

    def install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """SIGUSR1: one step more verbose; SIGUSR2: back to the initial level."""
        loop.add_signal_handler(
            signal.SIGUSR1, lambda: self.set(more_verbose(self.current), "SIGUSR1")
        )
        loop.add_signal_handler(signal.SIGUSR2, lambda: self.set(self.initial, "SIGUSR2"))


def configure_logging(level: str = "info", stream: TextIO | None = None) -> LogLevel:
    """structlog → one JSON object per line on `stream` (default: stderr). For each entry
    point to call once; the returned LogLevel changes the level later."""
    level = level.lower()
    wrapper = type("InstaSliceLogger", (structlog.BoundLoggerBase,), _level_methods(level))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=wrapper,
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=True,
    )
    return LogLevel(initial=level, wrapper=wrapper)
