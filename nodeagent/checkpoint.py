"""Intent records: the node agent's proof of what it created (docs/style.md §6).

Before any NVML call that creates or destroys, the agent writes what it is about to do into a
small JSON file per node (`<state-dir>/<node>.agent.json`), atomically (tmp + rename), and a
create's intent first into the node's intent journal (`<node>.agent.intents.jsonl`): one line
appended and `fdatasync`ed, the one sync on a pod's path (a snapshot made durable costs two,
the file's and its directory's, ~2-3x as long on this machine's disk: docs/benchmarks.md).
`load` replays the journal's lines newer than the snapshot (`intent_seq`); a snapshot made
durable lets the journal be emptied. After a crash the records are reconciled against what
NVML reports:

- a `creating` record claims the instances at exactly its placements (the allocator never
  promises one placement twice, and the agent checked the placement was free before it wrote
  the record), so a restart finishes the create or rolls it back, never creates twice;
- a `releasing` record is destroyed again (NOT_FOUND counts as done);
- an instance no record claims is foreign: reported, never destroyed.

The record is the only proof of ownership; a lost or corrupt checkpoint makes every instance
foreign (leaked, visible in MigNode), which is the safe way to fail. Values are frozen;
`Checkpoint` holds the current records and is replaced wholesale on each change.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

# "failed": this process wrote Failed (after rolling back whatever it made): final for that
# uid. Such a record holds no slice, goes when the allocation does, and is never written to
# disk (it proves nothing about hardware; a restarted agent decides from the phase alone).
# "warm": a slice made ahead of demand, no pod's yet (nodeagent/warm.py).
State = Literal["creating", "ready", "releasing", "failed", "warm"]
VERSION = 1


@dataclass(frozen=True, slots=True)
class SliceRecord:
    """One slice of a claim: where it goes and, once made, what NVML named it."""

    container: str
    profile: str
    profile_id: int
    gpu_uuid: str
    gpu_index: int
    start: int
    size: int
    gi_id: int | None = None
    ci_id: int | None = None
    mig_uuid: str | None = None  # for a whole GPU: its GPU UUID, once MIG is off on it
    kind: str = "mig"  # mig | gpu (a whole GPU; no instance, nothing to create or destroy)

    @property
    def whole(self) -> bool:
        return self.kind == "gpu"

    @property
    def done(self) -> bool:
        if self.whole:
            return self.mig_uuid is not None
        return self.gi_id is not None and self.ci_id is not None and self.mig_uuid is not None

    def cleared(self) -> SliceRecord:
        return replace(self, gi_id=None, ci_id=None, mig_uuid=None)


@dataclass(frozen=True, slots=True)
class ClaimRecord:
    uid: str  # the SliceAllocation's metadata.uid
    namespace: str
    name: str  # the claim id
    state: State
    slices: tuple[SliceRecord, ...]
    boot_id: str = ""
    updated: float = 0.0
    # Not persisted (_RUNTIME_FIELDS): what this process wrote and told. `announced`: Ready,
    # and the pod was told (SliceReady); a restarted agent says Ready again, which is how a
    # crash between the two writes is repaired. `message`: a "failed" record's Failed
    # message. `retry_s`: the next delay of a release NVML refused as IN_USE (doubling);
    # `in_use_told`: the pod was told so (SliceInUse, once).
    announced: bool = False
    message: str = ""
    retry_s: float = 0.0
    in_use_told: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class ModeIntent:
    """ "About to set GPU `gpu_uuid` to MIG mode `target` for claim `claim` (a uid)":
    written (fsynced) before SetMigMode, removed once the mode is verified or the change
    failed. Found at start, it is resolved from GetMigMode (docs/nodeagent.md)."""

    gpu_uuid: str
    gpu_index: int
    target: str  # enabled | disabled
    claim: str


@dataclass(frozen=True, slots=True)
class MaintenanceIntent:
    """ "About to pause the GPU Operator's clients and reset these GPUs into these MIG
    modes" (Ampere maintenance, nodeagent/maintenance.py): written (fsynced) before the
    first label patch. `labels`: the Operator labels as they were, restored exactly
    afterwards, and at start if a crash left this record behind."""

    modes: Mapping[str, str]  # GPU UUID → target mode
    labels: Mapping[str, str]  # nvidia.com/gpu.deploy.<component> → its value before


@dataclass(frozen=True, slots=True)
class DrainClock:
    """An Ampere maintenance drain (nodeagent/maintenance.py) of one GPU: kept across restarts
    so a restarted (or crash-looping) agent neither starts the clock afresh nor carries out an
    ask it gave up. `since`: when the drain began (wall time, seconds since the epoch: the
    monotonic clock does not survive a restart). `given_up`: the failure's message once the
    drain ran out (empty while it runs), `given_up_time` its RFC 3339 time."""

    target: str  # enabled | disabled
    since: float
    given_up: str = ""
    given_up_time: str = ""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    node: str
    boot_id: str = ""
    claims: Mapping[str, ClaimRecord] = field(default_factory=dict)  # by uid
    mode_changes: Mapping[str, ModeIntent] = field(default_factory=dict)  # by GPU UUID
    maintenance: MaintenanceIntent | None = None
    drains: Mapping[str, DrainClock] = field(default_factory=dict)  # by GPU UUID
    # the last intent-journal line this snapshot holds (`append_intent`); later ones replay
    intent_seq: int = 0

    def with_drains(self, drains: Mapping[str, DrainClock]) -> Checkpoint:
        return replace(self, drains=drains)

    def with_maintenance(self, intent: MaintenanceIntent | None) -> Checkpoint:
        return replace(self, maintenance=intent)

    def with_mode_intent(self, intent: ModeIntent) -> Checkpoint:
        return replace(self, mode_changes={**self.mode_changes, intent.gpu_uuid: intent})

    def without_mode_intent(self, gpu_uuid: str) -> Checkpoint:
        changes = {k: v for k, v in self.mode_changes.items() if k != gpu_uuid}
        return replace(self, mode_changes=changes)

    def with_claim(self, rec: ClaimRecord) -> Checkpoint:
        claims = dict(self.claims)
        claims[rec.uid] = rec
        return replace(self, claims=claims)

    def without(self, uid: str) -> Checkpoint:
        claims = {k: v for k, v in self.claims.items() if k != uid}
        return replace(self, claims=claims)


def to_json(cp: Checkpoint) -> dict[str, Any]:
    return {
        "version": VERSION,
        "node": cp.node,
        "bootID": cp.boot_id,
        "claims": [
            _claim_json(c)
            for c in sorted(cp.claims.values(), key=lambda c: c.key)
            if c.state != "failed"
        ],
        "modeChanges": [
            {"gpu_uuid": m.gpu_uuid, "gpu_index": m.gpu_index, "target": m.target, "claim": m.claim}
            for m in sorted(cp.mode_changes.values(), key=lambda m: m.gpu_index)
        ],
        "maintenance": (
            None
            if cp.maintenance is None
            else {"modes": dict(cp.maintenance.modes), "labels": dict(cp.maintenance.labels)}
        ),
        "drains": {
            uuid: {
                "target": d.target,
                "since": d.since,
                "givenUp": d.given_up,
                "givenUpTime": d.given_up_time,
            }
            for uuid, d in sorted(cp.drains.items())
        },
        "intentSeq": cp.intent_seq,
    }


# What dataclasses.asdict gives, field by field: asdict deep-copies recursively and took half
# of every save (2.6 of 5.3 ms CPU for a node holding 56 claims; saves run ~3 times a pod)
_SLICE_FIELDS = tuple(f.name for f in fields(SliceRecord))
_RUNTIME_FIELDS = frozenset({"announced", "message", "retry_s", "in_use_told"})
_CLAIM_FIELDS = tuple(f.name for f in fields(ClaimRecord) if f.name not in _RUNTIME_FIELDS)


def _claim_json(c: ClaimRecord) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(c, name) for name in _CLAIM_FIELDS}
    out["slices"] = [{name: getattr(s, name) for name in _SLICE_FIELDS} for s in c.slices]
    return out


def from_json(doc: Mapping[str, Any]) -> Checkpoint:
    if doc.get("version") != VERSION:
        raise ValueError(f"unsupported checkpoint version {doc.get('version')!r}")
    claims = {}
    for raw in doc.get("claims", []):
        slices = tuple(SliceRecord(**s) for s in raw["slices"])
        rec = ClaimRecord(**{**raw, "slices": slices})
        claims[rec.uid] = rec
    modes = [ModeIntent(**m) for m in doc.get("modeChanges", [])]  # added later: optional
    maint = doc.get("maintenance")  # added later still
    drains = {  # and later again
        uuid: DrainClock(
            str(d["target"]),
            float(d["since"]),
            str(d.get("givenUp", "")),
            str(d.get("givenUpTime", "")),
        )
        for uuid, d in (doc.get("drains") or {}).items()
    }
    return Checkpoint(
        node=doc["node"],
        boot_id=doc.get("bootID", ""),
        claims=claims,
        mode_changes={m.gpu_uuid: m for m in modes},
        maintenance=(
            None
            if not maint
            else MaintenanceIntent(dict(maint["modes"]), dict(maint.get("labels") or {}))
        ),
        drains=drains,
        intent_seq=int(doc.get("intentSeq") or 0),  # added later still
    )


def load(path: Path, node: str) -> Checkpoint:
    """The checkpoint at `path` with the intents journaled after it (`replay`); empty if there
    is none. A corrupt file is moved aside, and its journal with it (its instances then count
    as foreign: leaked and reported, never destroyed by guesswork; intents cannot be ordered
    against a snapshot that is lost)."""
    journal = journal_path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return replay(Checkpoint(node=node), journal)
    try:
        cp = from_json(json.loads(text))
    except (ValueError, KeyError, TypeError):
        stamp = int(time.time())
        path.rename(path.with_name(f"{path.name}.corrupt-{stamp}"))
        if journal.exists():
            journal.rename(journal.with_name(f"{journal.name}.corrupt-{stamp}"))
        return Checkpoint(node=node)
    return replay(cp, journal)


def journal_path(path: Path) -> Path:
    """The intent journal beside the checkpoint at `path`: `n.agent.intents.jsonl`."""
    return path.with_suffix(".intents.jsonl")


def append_intent(path: Path, seq: int, rec: ClaimRecord) -> None:
    """Journal `rec` (line `seq`) beside the checkpoint at `path`, on disk when this returns:
    one append and one `fdatasync` (the file's length is data to it); the directory is synced
    only when the journal is new. A crash mid-append leaves a torn last line, which `replay`
    skips: its intent was never acted on (NVML comes after this returns)."""
    journal = journal_path(path)
    new = not journal.exists()
    line = json.dumps({"seq": seq, "claim": _claim_json(rec)}, separators=_COMPACT) + "\n"
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
        os.fdatasync(fd)
    finally:
        os.close(fd)
    if new:
        _sync_dir(journal.parent)


def replay(cp: Checkpoint, journal: Path) -> Checkpoint:
    """`cp` with every journaled intent newer than it (`seq` > `cp.intent_seq`) put back, in
    order; `intent_seq` the newest line seen. Lines that do not parse (a torn last append)
    are skipped."""
    try:
        text = journal.read_text()
    except FileNotFoundError:
        return cp
    last = cp.intent_seq
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            seq = int(entry["seq"])
            raw = entry["claim"]
            rec = ClaimRecord(**{**raw, "slices": tuple(SliceRecord(**s) for s in raw["slices"])})
        except (ValueError, KeyError, TypeError):
            continue
        if seq > cp.intent_seq:
            cp = cp.with_claim(rec)
        last = max(last, seq)
    return replace(cp, intent_seq=last)


def clear_journal(path: Path) -> None:
    """Empty (or make) the intent journal beside the checkpoint at `path`: called once a
    durable snapshot holds every line (a truncation lost in a crash only leaves lines
    `replay` ignores, their `seq` not above the snapshot's). Made here, at a start, the
    journal's directory entry is synced before the first create needs it."""
    journal = journal_path(path)
    if journal.exists():
        os.truncate(journal, 0)
        return
    os.close(os.open(journal, os.O_WRONLY | os.O_CREAT, 0o600))
    _sync_dir(journal.parent)


def _sync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save(path: Path, cp: Checkpoint, durable: bool = True) -> None:
    """Atomic write (tmp + rename): a crash leaves the old or the new file, never a mix.
    `durable` also fsyncs file and directory, for records that must survive power loss: a
    MIG mode or maintenance intent, and a snapshot that lets the intent journal be emptied
    (a create's intent is journaled: `append_intent`). Later updates (ids, `ready`, removal)
    may be lost with the page cache: the restart then re-derives them from NVML."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    data = encode(cp, path).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        _sync_dir(path.parent)


# The JSON text of each claim of the last checkpoint saved to a path, by the record's id
# (records are frozen: an unchanged claim is the same object from one save to the next).
# A node saves ~3 times per pod and every save wrote all its claims: at 56 claims the
# encoding was most of a save's CPU; now a save encodes only the claims that changed.
_claim_texts: dict[Path, dict[int, tuple[ClaimRecord, str]]] = {}


def encode(cp: Checkpoint, path: Path | None = None) -> str:
    """`json.dumps(to_json(cp))`, compact; with `path`, each claim's text is reused from
    the previous save to that path when the claim is the same record."""
    known = _claim_texts.get(path, {}) if path is not None else {}
    fresh: dict[int, tuple[ClaimRecord, str]] = {}
    texts = []
    for c in sorted(cp.claims.values(), key=lambda c: c.key):
        if c.state == "failed":
            continue
        hit = known.get(id(c))
        if hit is None or hit[0] is not c:
            hit = (c, json.dumps(_claim_json(c), separators=_COMPACT))
        fresh[id(c)] = hit  # holds the record, so its id stays its own
        texts.append(hit[1])
    if path is not None:
        _claim_texts[path] = fresh
    doc = to_json(replace(cp, claims={}))
    head = json.dumps(doc, separators=_COMPACT)
    marker = '"claims":[]'
    assert head.count(marker) == 1, "a checkpoint field's text looks like the claims list"
    return head.replace(marker, '"claims":[' + ",".join(texts) + "]")


_COMPACT = (",", ":")
