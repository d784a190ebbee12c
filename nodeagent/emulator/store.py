"""One emulated node's state on disk: `<state dir>/<node>.json`, shared between processes.

Every access takes an fcntl lock on `<node>.lock` (shared to read, exclusive to change),
so the node agent, the CLI and tests can work on the same node at once; a change is
written to a temporary file and renamed over the old one, so a reader never sees half a
file and a crash leaves either the old or the new state. Every NVML call sees what any
other process did before it.

The parsed state is cached per store and reused while the file is provably unchanged: every
writer bumps a counter kept in the lock file (under the exclusive lock), and the cache key
is that counter plus the file's inode, mtime and size, so a read is a stat and an 8-byte
pread instead of a parse (an NVML walk makes dozens of calls; the counter catches what
mtime granularity and inode reuse could hide, the stat catches a hand edit). No fsync:
the state models GPUs, which do not survive a host crash either.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nodeagent.emulator.state import (
    OPS,
    ComputeInstance,
    EmulatorState,
    Event,
    FailRule,
    Gpu,
    GpuInstance,
    Op,
    Settings,
)

SCHEMA = 1
_NODE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


class StateError(Exception):
    """The node has no state file, or the file cannot be understood."""


class Box:
    """The state inside a transaction; assign `.state` to change it."""

    def __init__(self, state: EmulatorState) -> None:
        self.state = state


class NodeStore:
    def __init__(self, state_dir: Path, node: str) -> None:
        if not _NODE_NAME.match(node):
            raise ValueError(f"{node!r} is not a usable node name")
        self.dir = Path(state_dir)
        self.node = node
        self.path = self.dir / f"{node}.json"
        self._lock_path = self.dir / f"{node}.lock"
        # (version, inode, mtime_ns, size) -> the state parsed from that file; states are
        # frozen, so sharing one between calls and threads is safe
        self._cache: tuple[tuple[int, int, int, int], EmulatorState] | None = None

    def exists(self) -> bool:
        return self.path.exists()

    @contextmanager
    def _locked(self, exclusive: bool) -> Iterator[int]:
        """The lock file's descriptor, locked; closing it releases the lock."""
        try:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _version(fd: int) -> int:
        return int.from_bytes(os.pread(fd, 8, 0) or b"\0", "little")

    def _key(self, fd: int) -> tuple[int, int, int, int]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise StateError(f"node {self.node} is not provisioned in {self.dir}") from None
        return (self._version(fd), st.st_ino, st.st_mtime_ns, st.st_size)

    def _load(self, fd: int) -> EmulatorState:
        key = self._key(fd)
        cached = self._cache
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            raise StateError(f"node {self.node} is not provisioned in {self.dir}") from None
        try:
            state = decode(json.loads(text))
        except (ValueError, KeyError, TypeError) as exc:
            raise StateError(f"{self.path}: {exc}") from exc
        self._cache = (key, state)
        return state

    def _write(self, fd: int, state: EmulatorState) -> None:
        tmp_fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{self.node}.", suffix=".tmp")
        try:
            with os.fdopen(tmp_fd, "w") as f:
                json.dump(encode(state), f, indent=1)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        os.pwrite(fd, (self._version(fd) + 1).to_bytes(8, "little"), 0)
        self._cache = (self._key(fd), state)

    def read(self) -> EmulatorState:
        with self._locked(exclusive=False) as fd:
            return self._load(fd)

    @contextmanager
    def transaction(self) -> Iterator[Box]:
        """Read under an exclusive lock; write back if `box.state` was replaced."""
        with self._locked(exclusive=True) as fd:
            before = self._load(fd)
            box = Box(before)
            yield box
            if box.state is not before:
                self._write(fd, box.state)

    def create(self, state: EmulatorState) -> bool:
        """Write `state` unless the node already has a file; True if written."""
        with self._locked(exclusive=True) as fd:
            if self.path.exists():
                return False
            self._write(fd, state)
            return True


# ---- JSON codec ----------------------------------------------------------------------------


def encode(state: EmulatorState) -> dict[str, Any]:
    return {"schema": SCHEMA, **asdict(state)}


def _ci(raw: dict[str, Any]) -> ComputeInstance:
    return ComputeInstance(
        id=raw["id"],
        profile=raw["profile"],
        start=raw["start"],
        size=raw["size"],
        uuid=raw["uuid"],
        mig_index=raw["mig_index"],
        serial=raw["serial"],
        processes=tuple(raw["processes"]),
    )


def _gi(raw: dict[str, Any]) -> GpuInstance:
    return GpuInstance(
        id=raw["id"],
        profile_id=raw["profile_id"],
        start=raw["start"],
        size=raw["size"],
        serial=raw["serial"],
        cis=tuple(_ci(c) for c in raw["cis"]),
    )


def _gpu(raw: dict[str, Any]) -> Gpu:
    return Gpu(
        index=raw["index"],
        model=raw["model"],
        uuid=raw["uuid"],
        mig_current=raw["mig_current"],
        mig_pending=raw["mig_pending"],
        lost=raw["lost"],
        processes=tuple(raw["processes"]),
        gis=tuple(_gi(g) for g in raw["gis"]),
    )


def _op(raw: str) -> Op:
    for op in OPS:
        if op == raw:
            return op
    raise ValueError(f"unknown operation {raw!r}")


def _settings(raw: dict[str, Any]) -> Settings:
    return Settings(
        create_ms=raw["create_ms"],
        destroy_ms=raw["destroy_ms"],
        capacity_without_mig=raw["capacity_without_mig"],
        fail=tuple(
            FailRule(op=_op(r["op"]), code=r["code"], count=r["count"], skip=r["skip"])
            for r in raw["fail"]
        ),
    )


def decode(raw: dict[str, Any]) -> EmulatorState:
    if raw.get("schema") != SCHEMA:
        raise ValueError(f"unsupported schema {raw.get('schema')!r}")
    return EmulatorState(
        node=raw["node"],
        boot_id=raw["boot_id"],
        gpus=tuple(_gpu(g) for g in raw["gpus"]),
        settings=_settings(raw["settings"]),
        events=tuple(Event(**e) for e in raw["events"]),
        next_serial=raw["next_serial"],
        next_event=raw["next_event"],
        next_pid=raw["next_pid"],
    )
