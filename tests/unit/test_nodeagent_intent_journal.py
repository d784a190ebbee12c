"""The intent journal (nodeagent/checkpoint.py, nodeagent/state.py): a create's intent is on
disk, durably, with one sync (issue 37: the agent's step on a pod's path), and `load` still
gives every record a crash at any step could need — the intent journaled but not yet in the
snapshot, a torn last line, a journal not yet emptied after a compaction, a corrupt snapshot.

The crash of a whole agent process between the intent and NVML (nothing made twice, nothing
leaked) is tests/integration/test_nodeagent.py's (`test_sigkill_after_the_intent_*`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nodeagent import checkpoint, state
from nodeagent.checkpoint import Checkpoint, ClaimRecord, SliceRecord
from nodeagent.state import AgentNode


def _rec(uid: str, state_: Any = "creating", gi: int | None = None) -> ClaimRecord:
    sl = SliceRecord("c", "1g.10gb", 19, "GPU-0", 0, 3, 1, gi, None if gi is None else 0)
    return ClaimRecord(uid, "ns", f"claim-{uid}", state_, (sl,), "b1", 1.0)


async def _started(path: Path) -> AgentNode:
    """A node agent's state as a start leaves it: the checkpoint loaded and written back (made
    durable: it empties a journal the last process left)."""
    st = AgentNode(node="n1", boot_id="b1", checkpoint_path=path)
    st.set_checkpoint(checkpoint.load(path, "n1"))
    await st.persist()
    return st


class Syncs:
    """Counts `os.fsync` and `os.fdatasync` calls (the checkpoint's only syncs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in ("fsync", "fdatasync"):
            monkeypatch.setattr(os, name, self._counting(name, getattr(os, name)))

    def _counting(self, name: str, real: Callable[[int], None]) -> Callable[[int], None]:
        def call(fd: int) -> None:
            self.calls.append(name)
            real(fd)

        return call


async def test_a_create_intent_is_on_disk_with_one_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "n1.agent.json"
    st = await _started(path)  # the journal made (its directory synced), empty
    syncs = Syncs(monkeypatch)
    await st.persist_intent(_rec("u1"))
    assert syncs.calls == ["fdatasync"]  # was fsync of the snapshot, then of its directory
    assert checkpoint.load(path, "n1").claims.keys() == {"u1"}  # on disk when it returns
    assert st.cp.claims["u1"] == _rec("u1")


async def test_intents_journaled_after_the_snapshot_are_replayed_and_older_ones_are_not(
    tmp_path: Path,
) -> None:
    path = tmp_path / "n1.agent.json"
    st = await _started(path)
    await st.persist_intent(_rec("gone"))
    st.drop("gone")  # rolled back: the snapshot written next no longer holds it
    await st.persist()
    await st.persist_intent(_rec("u1"))
    # a crash here: the snapshot lacks u1, the journal holds both lines
    assert len(checkpoint.journal_path(path).read_text().splitlines()) == 2
    cp = checkpoint.load(path, "n1")
    assert cp.claims == {"u1": _rec("u1")}  # u1 replayed; "gone" older than the snapshot
    made = _rec("u1", "ready", gi=4)
    st.put(made)
    await st.persist()
    assert checkpoint.load(path, "n1").claims == {"u1": made}  # the line no longer wins
    # a restarted agent continues the numbering: its next line is newer than the snapshot
    st2 = await _started(path)
    await st2.persist_intent(_rec("u2"))
    assert checkpoint.load(path, "n1").claims.keys() == {"u1", "u2"}


async def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "n1.agent.json"
    st = await _started(path)
    await st.persist_intent(_rec("u1"))
    with checkpoint.journal_path(path).open("a") as f:
        f.write('{"seq": 9, "claim": {"uid": "u2", "nam')  # a crash mid-append
    assert checkpoint.load(path, "n1").claims == {"u1": _rec("u1")}


async def test_the_journal_is_emptied_after_a_durable_snapshot_every_so_many_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(state, "JOURNAL_COMPACT_AFTER", 3)
    path = tmp_path / "n1.agent.json"
    journal = checkpoint.journal_path(path)
    journal.write_text(json.dumps({"seq": 7, "claim": checkpoint._claim_json(_rec("old"))}) + "\n")
    st = AgentNode(node="n1", boot_id="b1", checkpoint_path=path)
    st.set_checkpoint(checkpoint.load(path, "n1"))  # what a start does
    assert st.cp.claims.keys() == {"old"} and st.cp.intent_seq == 7
    syncs = Syncs(monkeypatch)
    await st.persist()  # the start's: durable, and the last process's lines go
    assert syncs.calls == ["fsync", "fsync"] and journal.read_text() == ""  # emptied, kept
    assert checkpoint.load(path, "n1").intent_seq == 7
    for i in range(3):
        await st.persist_intent(_rec(f"u{i}"))
        st.put(_rec(f"u{i}", "ready", gi=i))
        syncs.calls.clear()
        await st.persist()
        assert syncs.calls == ([] if i < 2 else ["fsync", "fsync"])
    assert journal.read_text() == ""
    assert checkpoint.load(path, "n1").claims.keys() == {"old", "u0", "u1", "u2"}


def test_a_corrupt_snapshot_sets_its_journal_aside_too(tmp_path: Path) -> None:
    """The journal's lines cannot be ordered against a snapshot that is lost: replayed on an
    empty one, a long-released intent would claim what now sits at its placement."""
    path = tmp_path / "n1.agent.json"
    checkpoint.append_intent(path, 3, _rec("u1"))
    assert checkpoint.load(path, "n1").claims.keys() == {"u1"}  # no snapshot yet: replayed
    path.write_text("{not json")
    assert checkpoint.load(path, "n1") == Checkpoint("n1")
    assert len(list(tmp_path.glob("n1.agent.intents.jsonl.corrupt-*"))) == 1
    assert not checkpoint.journal_path(path).exists()
