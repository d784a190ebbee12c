"""One emulated node's state on disk: `<state dir>/<node>.json`, shared between processes.

A change takes an exclusive fcntl lock on `<node>.lock`, so the node agent, the CLI and
tests can change the same node at once; it is written to a temporary file and renamed over
the old one, so a reader never sees half a file and a crash leaves either the old or the
new state. Readers therefore need no lock: every NVML call sees what any other process
finished before it.

The parsed state is cached per store and reused while the file is provably the same: a
writer gives every new file a modification time strictly above the previous one, so
(inode, mtime, size) names one version of the file, and a read that finds the key
unchanged costs one stat() instead of a parse (the MIG-handle walk makes dozens of NVML
calls per GPU, and one process may serve a thousand emulated nodes). No fsync: the state
models GPUs, which do not survive a host crash either.

A write costs what a burst can afford (every GI and CI create is one): the temporary file
has a fixed name (the writer holds the lock; a crash's leftover is simply truncated), and
each GPU's JSON form is kept with the GPU object it was made from, so a write re-encodes
only the GPUs that changed (states are frozen: an unchanged GPU is the same object).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from common.catalog import GpuModel, model_to_json, parse_model
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
        self._tmp_path = self.dir / f".{node}.json.tmp"
        # id(gpu) -> (that GPU, its JSON form) for the GPUs of the last state written
        self._plain_gpus: dict[int, tuple[Gpu, dict[str, Any]]] = {}
        # (inode, mtime_ns, size) -> the state parsed from that file; states are frozen,
        # so sharing one between calls and threads is safe
        self._cache: tuple[tuple[int, int, int], EmulatorState] | None = None

    def exists(self) -> bool:
        return self.path.exists()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The node's exclusive write lock; closing the descriptor releases it."""
        try:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _missing(self) -> StateError:
        return StateError(f"node {self.node} is not provisioned in {self.dir}")

    def _load(self) -> EmulatorState:
        cached = self._cache
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise self._missing() from None
        if cached is not None and cached[0] == (st.st_ino, st.st_mtime_ns, st.st_size):
            return cached[1]
        try:
            with open(self.path, "rb") as f:  # key and bytes from the same file
                st = os.fstat(f.fileno())
                raw = f.read()
        except FileNotFoundError:
            raise self._missing() from None
        try:
            state = decode(json.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            raise StateError(f"{self.path}: {exc}") from exc
        self._cache = ((st.st_ino, st.st_mtime_ns, st.st_size), state)
        return state

    def _write(self, state: EmulatorState) -> None:
        """Under the lock: a new file, renamed over the old one, with a later mtime."""
        try:
            previous = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            previous = 0
        mtime = max(time.time_ns(), previous + 1)
        # one compact line: json.dumps without indent runs the C encoder, while
        # json.dump(indent=...) streams through the pure-Python one (10x slower)
        data = json.dumps(self._encode(state), separators=(",", ":")).encode()
        tmp = self._tmp_path
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
                os.utime(fd, ns=(mtime, mtime))
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        st = os.stat(self.path)
        self._cache = ((st.st_ino, st.st_mtime_ns, st.st_size), state)

    def _encode(self, state: EmulatorState) -> dict[str, Any]:
        """`encode(state)`, reusing the JSON form of every GPU unchanged since the last write."""
        known = self._plain_gpus
        fresh: dict[int, tuple[Gpu, dict[str, Any]]] = {}
        for gpu in state.gpus:
            hit = known.get(id(gpu))
            fresh[id(gpu)] = hit if hit is not None and hit[0] is gpu else (gpu, _plain(gpu))
        self._plain_gpus = fresh  # holds the GPUs, so their ids stay theirs
        return encode(state, [fresh[id(g)][1] for g in state.gpus])

    def read(self) -> EmulatorState:
        return self._load()

    @contextmanager
    def transaction(self) -> Iterator[Box]:
        """Read under the exclusive lock; write back if `box.state` was replaced."""
        with self._locked():
            before = self._load()
            box = Box(before)
            yield box
            if box.state is not before:
                self._write(box.state)

    def create(self, state: EmulatorState) -> bool:
        """Write `state` unless the node already has a file; True if written."""
        with self._locked():
            if self.path.exists():
                return False
            self._write(state)
            return True

    def overwrite(self, state: EmulatorState) -> None:
        """Write `state` whatever the node had (its GPUs provisioned anew)."""
        with self._locked():
            self._write(state)


# ---- JSON codec ----------------------------------------------------------------------------


def encode(state: EmulatorState, gpus: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The state file's JSON form; `gpus`: the GPUs' forms when already known."""
    plain: dict[str, Any] = {
        f: (gpus if f == "gpus" and gpus is not None else _plain(getattr(state, f)))
        for f in state.__dataclass_fields__
    }
    tables = {g.table.name: model_to_json(g.table) for g in state.gpus if g.table is not None}
    return {"schema": SCHEMA, **plain, **({"tables": tables} if tables else {})}


def _plain(obj: Any) -> Any:
    """`dataclasses.asdict` without its deep copies (the state is frozen dataclasses,
    tuples and scalars, so nothing needs copying); a third of a write's time otherwise."""
    if isinstance(obj, tuple):
        return [_plain(x) for x in obj]
    if isinstance(obj, GpuModel):  # a table model: kept once per file, named by its GPUs
        return obj.name
    fields = getattr(obj, "__dataclass_fields__", None)
    if fields is not None:
        return {f: _plain(getattr(obj, f)) for f in fields}
    return obj


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


def _gpu(raw: dict[str, Any], tables: dict[str, GpuModel]) -> Gpu:
    table = raw.get("table")
    return Gpu(
        index=raw["index"],
        model=raw["model"],
        uuid=raw["uuid"],
        mig_current=raw["mig_current"],
        mig_pending=raw["mig_pending"],
        lost=raw["lost"],
        processes=tuple(raw["processes"]),
        gis=tuple(_gi(g) for g in raw["gis"]),
        table=None if table is None else tables[table],
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
        # keys added later: older state files lack them
        mode_ms=raw.get("mode_ms", 0),
        vm=raw.get("vm", False),
        disable_with_instances=_disable_rule(raw.get("disable_with_instances", "in_use")),
        driver_clients=tuple(raw.get("driver_clients", ())),
    )


def _disable_rule(raw: str) -> Literal["in_use", "destroy"]:
    if raw == "in_use":
        return "in_use"
    if raw == "destroy":
        return "destroy"
    raise ValueError(f"disable_with_instances must be in_use or destroy, not {raw!r}")


def decode(raw: dict[str, Any]) -> EmulatorState:
    if raw.get("schema") != SCHEMA:
        raise ValueError(f"unsupported schema {raw.get('schema')!r}")
    tables = {name: parse_model(t, name) for name, t in (raw.get("tables") or {}).items()}
    return EmulatorState(
        node=raw["node"],
        boot_id=raw["boot_id"],
        gpus=tuple(_gpu(g, tables) for g in raw["gpus"]),
        settings=_settings(raw["settings"]),
        events=tuple(Event(**e) for e in raw["events"]),
        next_serial=raw["next_serial"],
        next_event=raw["next_event"],
        next_pid=raw["next_pid"],
        provisioned_mode=raw.get("provisioned_mode", -1),
    )
