"""A checkpoint save encodes only the claims that changed since the last save to its path,
and writes exactly what `to_json` says (docs/benchmarks.md, "Issue 25, CPU per pod": a node
saves ~3 times per pod, and every save used to encode all of the node's claims)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent import checkpoint
from nodeagent.checkpoint import Checkpoint, ClaimRecord, MaintenanceIntent, ModeIntent, SliceRecord


def _claim(i: int, state: Any = "ready", gi: int | None = 1) -> ClaimRecord:
    sl = SliceRecord("c", "1g.10gb", 19, f"GPU-{i % 8}", i % 8, i % 7, 1, gi, 0, f"MIG-{i}")
    return ClaimRecord(f"uid-{i}", "ns", f"claim-{i}", state, (sl,), "boot", float(i))


def _compact(cp: Checkpoint) -> str:
    return json.dumps(checkpoint.to_json(cp), separators=(",", ":"))


def test_a_save_encodes_only_the_changed_claims(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = checkpoint._claim_json

    def counting(c: ClaimRecord) -> dict[str, Any]:
        calls.append(c.uid)
        return real(c)

    monkeypatch.setattr(checkpoint, "_claim_json", counting)
    path = tmp_path / "n1.agent.json"
    cp = Checkpoint("n1", "boot")
    for i in range(20):
        cp = cp.with_claim(_claim(i))
    checkpoint.save(path, cp, durable=False)
    assert len(calls) == 20
    calls.clear()
    cp = cp.with_claim(_claim(7, gi=5)).with_claim(_claim(20)).without("uid-3")
    checkpoint.save(path, cp, durable=False)
    assert sorted(calls) == ["uid-20", "uid-7"]  # the rest reused
    assert checkpoint.load(path, "n1") == cp
    assert path.read_text() == _compact(cp)
    calls.clear()
    checkpoint.save(tmp_path / "other.agent.json", cp, durable=False)  # another path: its own
    assert len(calls) == 20


_claims = st.lists(
    st.builds(
        _claim,
        st.integers(0, 30),
        st.sampled_from(["creating", "ready", "releasing", "failed"]),
        st.none() | st.integers(0, 6),
    ),
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(rounds=st.lists(_claims, min_size=1, max_size=4), maint=st.booleans())
def test_encode_is_to_json_after_any_sequence_of_saves(
    tmp_path_factory: pytest.TempPathFactory, rounds: list[list[ClaimRecord]], maint: bool
) -> None:
    """Across saves to one path, with claims kept (the same record), replaced, dropped,
    added or failed (never written), the text is always `to_json`'s, compact."""
    path = tmp_path_factory.mktemp("cp") / "n.agent.json"
    cp = Checkpoint("n", 'boot "x"', mode_changes={"G": ModeIntent("G", 0, "enabled", "u")})
    if maint:
        cp = cp.with_maintenance(MaintenanceIntent({"G": "enabled"}, {"a": "b"}))
    for claims in rounds:
        kept = {u: c for u, c in cp.claims.items() if len(u) % 2 == 0}  # the same objects
        cp = Checkpoint(cp.node, cp.boot_id, {**kept, **{c.uid: c for c in claims}},
                        cp.mode_changes, cp.maintenance)  # fmt: skip
        assert checkpoint.encode(cp, path) == _compact(cp)
        assert checkpoint.from_json(json.loads(checkpoint.encode(cp, path))) == Checkpoint(
            cp.node,
            cp.boot_id,
            {u: c for u, c in cp.claims.items() if c.state != "failed"},
            cp.mode_changes,
            cp.maintenance,
        )
