"""The emulator's file store (nodeagent/emulator/store.py): what a write costs and that the
file it writes is exactly the state's JSON form, whoever changed which GPU."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from nodeagent.emulator import provision
from nodeagent.emulator import store as store_mod
from nodeagent.emulator.state import EmulatorState, Gpu
from nodeagent.emulator.store import NodeStore, decode, encode


def _node(tmp_path: Path, gpus: int = 8) -> NodeStore:
    provision(tmp_path, "n0", ["H100-80GB"] * gpus)
    return NodeStore(tmp_path, "n0")


def _lose(store: NodeStore, index: int) -> None:
    with store.transaction() as box:
        gpu = box.state.gpus[index]
        box.state = box.state.with_gpu(replace(gpu, lost=not gpu.lost))


def _gpu_encodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the GPUs turned into JSON form from now on."""
    seen: list[int] = []
    real = store_mod._plain

    def counting(obj: Any) -> Any:
        if isinstance(obj, Gpu):
            seen.append(obj.index)
        return real(obj)

    monkeypatch.setattr(store_mod, "_plain", counting)
    return seen


def test_a_write_encodes_only_the_gpus_that_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _node(tmp_path)
    _lose(store, 0)  # the first write of this store encodes every GPU
    seen = _gpu_encodes(monkeypatch)
    _lose(store, 3)
    _lose(store, 5)
    assert seen == [3, 5]


def _on_disk(store: NodeStore) -> tuple[bytes, EmulatorState]:
    raw = store.path.read_bytes()
    return raw, decode(json.loads(raw))


def test_the_file_is_the_states_json_form_after_changes_from_two_stores(tmp_path: Path) -> None:
    """Another process's write (a second store) replaces GPUs this store has forms for:
    its next write must not reuse a form of a GPU that changed meanwhile."""
    mine = _node(tmp_path, gpus=4)
    other = NodeStore(tmp_path, "n0")
    for store, index in [(mine, 0), (other, 0), (mine, 1), (other, 2), (mine, 0), (mine, 3)]:
        _lose(store, index)
        raw, state = _on_disk(store)
        assert state == store.read() == other.read()
        assert raw == json.dumps(encode(state), separators=(",", ":")).encode()
    assert [g.lost for g in mine.read().gpus] == [True, True, True, True]


def test_a_leftover_temporary_file_of_a_crashed_writer_is_overwritten(tmp_path: Path) -> None:
    store = _node(tmp_path, gpus=2)
    leftover = tmp_path / ".n0.json.tmp"
    leftover.write_text('{"half": ')  # a writer died mid-write
    _lose(store, 1)
    assert store.read().gpus[1].lost
    assert not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n0.json", "n0.lock"]
