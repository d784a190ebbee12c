"""Creates in flight per GPU and the placer's first pass that avoids busy GPUs.

Covers what counts as in flight (assumed, `Pending`, `Creating`; not `Ready`, `Failed`, being
deleted), the per-GPU counts through assume / confirm / Ready / forget / removal, the placer
sending a second pod to another GPU while the first one's slice is being made (and packing
as before once it is made, or with the setting off), failed GPUs avoided too, and, as
hypothesis properties over random fleets and event sequences: the second index answers as
the engine's scan of the snapshot with the busy GPUs left out; the first pass never uses a
busy GPU and only places where today's placement could; a pod today's placement places is
always placed; the setting off changes no decision. The flag (default, value, bad
values refused naming it). Leaves out the API server
(tests/integration/test_allocator.py::test_a_second_pod_avoids_a_gpu_busy_making_a_slice)
and the timing trade (the `lanes` and `inflight` scenarios of bench/placement_scenarios.py,
docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common.objects import Phase
from common.placement import Pending, Placement, Policy, Snapshot, engine
from testkit.builders import (
    gpu_uuid,
    make_allocation,
    make_mig_node,
    make_node,
    make_pod,
    quiet_placer,
)
from webhook.allocator import pods as podlib
from webhook.allocator.inflight import InFlight, making
from webhook.allocator.placer import Placer
from webhook.allocator.state import ClusterState
from webhook.main import parse_args

pytestmark = pytest.mark.timeout(60)

Obj = dict[str, Any]
H100 = "H100-80GB"


def fleet(nodes: int, gpus: int, limit: int) -> ClusterState:
    state = ClusterState(avoid_creates_in_flight=limit)
    for i in range(nodes):
        name = f"n{i}"
        state.upsert_node(make_node(name, cpu="64", memory="256Gi", pods=110, gpus=gpus))
        state.upsert_mig_node(make_mig_node(name, [H100] * gpus))
    return state


def alloc(name: str, node: str, slices: list[tuple[str, int, int, int]], **kw: Any) -> Obj:
    """An allocation of pod `name`: slices (profile, gpu index, start, size)."""
    pod = make_pod(name, uid=name, claim=f"c-{name}")
    return make_allocation(pod, node, [("main", p, g, s, n) for p, g, s, n in slices], **kw)


# --- what counts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "deleting", "assumed", "counts"),
    [
        (Phase.PENDING, False, False, True),  # created, the agent has not started
        (Phase.CREATING, False, False, True),  # the agent is making it
        (Phase.READY, False, False, False),
        (Phase.FAILED, False, False, False),
        (Phase.RELEASING, False, False, False),
        (Phase.CREATING, True, False, False),  # being deleted: a release, not a create
        (Phase.PENDING, False, True, True),  # decided, create not seen back yet
    ],
)
def test_what_is_in_flight(phase: Phase, deleting: bool, assumed: bool, counts: bool) -> None:
    from common.allocation import SliceAllocation

    view = SliceAllocation.parse(
        alloc("p", "n0", [("1g.10gb", 0, 0, 1)], phase=phase, deleting=deleting)
    )
    assert making(view, assumed=assumed) is counts


def test_counts_follow_assume_confirm_ready_forget_and_removal() -> None:
    state = fleet(1, 2, limit=2)
    two = alloc("a", "n0", [("1g.10gb", 0, 0, 1), ("1g.10gb", 0, 1, 1)])
    one = alloc("b", "n0", [("1g.10gb", 1, 0, 1)])
    g0, g1 = gpu_uuid("n0", 0), gpu_uuid("n0", 1)
    key = state.assume(two).key
    state.assume(one)
    assert (state.in_flight.count("n0", g0), state.in_flight.count("n0", g1)) == (2, 1)
    assert state.busy_gpus() == {("n0", g0)}  # 2 slices on GPU 0 reach the limit of 2
    state.confirm(two)  # written, no status yet: still Pending
    assert state.busy_gpus() == {("n0", g0)}
    state.upsert_allocation({**two, "status": {"phase": Phase.CREATING.value}})
    assert state.in_flight.count("n0", g0) == 2
    state.upsert_allocation({**two, "status": {"phase": Phase.READY.value}})
    assert state.in_flight.count("n0", g0) == 0 and state.busy_gpus() == frozenset()
    state.forget(state.assume(alloc("c", "n0", [("1g.10gb", 0, 2, 1)])).key)
    assert state.in_flight.count("n0", g0) == 0
    state.remove_allocation(one)
    assert state.in_flight.count("n0", g1) == 0
    assert key in state.allocations


def test_off_counts_but_never_calls_a_gpu_busy() -> None:
    state = fleet(1, 1, limit=0)
    state.assume(alloc("a", "n0", [("1g.10gb", 0, 0, 1)]))
    assert state.in_flight.count("n0", gpu_uuid("n0", 0)) == 1
    assert state.busy_gpus() == frozenset()
    with pytest.raises(RuntimeError, match="avoid_creates_in_flight"):
        state.decide_calm(podlib.pod_request(make_pod("q")), Policy.INSTASLICE, None)
    with pytest.raises(ValueError, match="avoid_creates_in_flight"):
        InFlight(-1)


# --- the placer ----------------------------------------------------------------------------


def decide(placer: Placer, name: str, slices: dict[str, dict[str, int]] | None = None) -> Obj:
    """Place pod `name` as the placer does; its assumed SliceAllocation."""
    pod = make_pod(name, uid=name, claim=f"c-{name}", slices=slices)
    placer.state.upsert_pod(pod)
    track = placer.tracks.ensure(name)
    placer.decide(name)
    assert track.create is not None, f"{name} was not placed"
    return track.create


def gpus_of(body: Obj) -> list[tuple[str, int]]:
    return [(body["spec"]["nodeName"], s["gpuIndex"]) for s in body["spec"]["slices"]]


@pytest.mark.parametrize(
    ("limit", "second"),
    [
        (0, ("n0", 0)),  # off: packs onto the GPU the first pod broke open
        (1, ("n0", 1)),  # GPU 0 is making a slice: another GPU takes the second pod
        (2, ("n0", 0)),  # one slice in flight is below the limit of 2
    ],
)
def test_a_second_pod_avoids_a_busy_gpu(limit: int, second: tuple[str, int]) -> None:
    placer = quiet_placer(fleet(2, 2, limit))
    first = decide(placer, "a")
    assert gpus_of(first) == [("n0", 0)]
    assert gpus_of(decide(placer, "b")) == [second]


def test_once_made_the_gpu_is_packed_again() -> None:
    placer = quiet_placer(fleet(1, 2, limit=1))
    first = decide(placer, "a")
    assert gpus_of(decide(placer, "b")) == [("n0", 1)]
    placer.state.upsert_allocation({**first, "status": {"phase": Phase.READY.value}})
    # GPU 1 is busy now, GPU 0 not: the third pod goes back to GPU 0
    assert gpus_of(decide(placer, "c")) == [("n0", 0)]


def test_when_only_busy_gpus_fit_the_pod_is_placed_there() -> None:
    placer = quiet_placer(fleet(1, 1, limit=1))
    decide(placer, "a")
    assert gpus_of(decide(placer, "b")) == [("n0", 0)]  # nothing else: no waiting


def test_failed_gpus_and_busy_gpus_are_both_avoided_first() -> None:
    placer = quiet_placer(fleet(1, 3, limit=1))
    decide(placer, "a")  # GPU 0 busy
    pod = make_pod("b", uid="b", claim="c-b")
    placer.state.upsert_pod(pod)
    track = placer.tracks.ensure("b")
    track.failed_gpus = frozenset({("n0", gpu_uuid("n0", 1))})
    placer.decide("b")
    assert track.create is not None and gpus_of(track.create) == [("n0", 2)]


# --- properties ----------------------------------------------------------------------------

PROFILES = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb")
PHASES = (Phase.PENDING, Phase.CREATING, Phase.READY)

# An event: (pod number, GPU index, profile, phase or "assume" or "gone")
events_st = st.lists(
    st.tuples(
        st.integers(0, 11),
        st.integers(0, 5),
        st.sampled_from(PROFILES),
        st.sampled_from((*PHASES, "assume", "gone")),
    ),
    max_size=24,
)
request_st = st.lists(st.sampled_from(PROFILES), min_size=1, max_size=3)
# a fleet of 2 nodes x `gpus`, `events` replayed on it, then pods asking `asks` in turn
random_fleets = given(
    limit=st.integers(1, 3),
    gpus=st.integers(1, 3),
    events=events_st,
    asks=st.lists(request_st, min_size=1, max_size=4),
)


def replay(state: ClusterState, events: list[tuple[int, int, str, Any]], gpus: int) -> None:
    """Apply `events` to `state`: each pod holds at most one allocation, on the slot the
    engine gives its profile on the named GPU (so the fleet stays legal)."""
    for pod_no, gpu_no, profile, what in events:
        name = f"p{pod_no}"
        node, gpu = f"n{gpu_no // gpus}", gpu_no % gpus
        current = next(iter(state.allocations_of(name)), None)
        if what == "gone":
            if current is not None:
                state.remove_allocation(current.obj)
            continue
        if current is not None:  # a phase change of what it holds
            if what != "assume" and not state.is_assumed(current.key):
                state.upsert_allocation({**current.obj, "status": {"phase": what.value}})
            continue
        start = free_start(state, node, gpu, profile)
        if start is None:
            continue
        size = {"1g.10gb": 1, "1g.20gb": 2, "2g.20gb": 2, "3g.40gb": 4}[profile]
        body = alloc(name, node, [(profile, gpu, start, size)])
        if what == "assume":
            state.assume(body)
        else:
            state.upsert_allocation({**body, "status": {"phase": what.value}})


def free_start(state: ClusterState, node: str, gpu: int, profile: str) -> int | None:
    """Where the engine would put one `profile` slice on that GPU alone, if anywhere."""
    only = tuple(
        dataclasses.replace(n, gpus=tuple(g for g in n.gpus if g.index == gpu))
        for n in state.snapshot().nodes
        if n.name == node
    )
    got = engine.place(Snapshot(only), podlib.pod_request(_asking("x", [profile])))
    return got.slices[0].start if isinstance(got, Placement) else None


def _asking(name: str, profiles: list[str]) -> Obj:
    asks: dict[str, int] = {}
    for p in profiles:
        asks[p] = asks.get(p, 0) + 1
    return make_pod(name, uid=name, claim=f"c-{name}", slices={"main": asks})


def assert_free(result: Placement, snap: Snapshot) -> None:
    (node,) = (n for n in snap.nodes if n.name == result.node)
    for s in result.slices:
        mask = ((1 << s.size) - 1) << s.start
        gpu = node.gpus[s.gpu_index]
        assert gpu.healthy and not gpu.mask & mask, f"{s} overlaps {gpu.occupied}"


def busy_gpus_used(result: Placement, state: ClusterState) -> list[tuple[str, int]]:
    busy = state.busy_gpus()
    return [
        (result.node, s.gpu_index)
        for s in result.slices
        if (result.node, gpu_uuid(result.node, s.gpu_index)) in busy
    ]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@random_fleets
def test_first_pass_is_the_scan_without_busy_gpus_and_never_loses_a_pod(
    limit: int, gpus: int, events: list[tuple[int, int, str, Any]], asks: list[list[str]]
) -> None:
    state = fleet(2, gpus, limit)
    replay(state, events, gpus)
    for i, profiles in enumerate(asks):  # decisions between events: the indexes kept up
        req = podlib.pod_request(_asking(f"q{i}", profiles))
        today = state.decide(req, Policy.INSTASLICE, None)
        calm = state.decide_calm(req, Policy.INSTASLICE, None)
        scan = engine.place(state.snapshot(exclude=state.busy_gpus()), req)
        assert calm == scan  # the second index answers as the scan would
        if isinstance(calm, Placement):
            assert busy_gpus_used(calm, state) == []
            assert isinstance(today, Placement)
            assert_free(calm, state.snapshot())  # legal on the real snapshot
        if isinstance(calm, Placement) and calm != today:
            event("the first pass moved the pod off a busy GPU")
        elif state.busy_gpus() and isinstance(calm, Pending) and isinstance(today, Placement):
            event("only a busy GPU fits: the normal pass places it")
        final = calm if isinstance(calm, Placement) else today
        assert isinstance(final, Placement) == isinstance(today, Placement)
        if isinstance(final, Placement):  # decide it, as the placer would, and go on
            body = alloc(f"q{i}", final.node, [
                (s.profile, s.gpu_index, s.start, s.size) for s in final.slices
            ])  # fmt: skip
            state.assume(body)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@random_fleets
def test_the_setting_off_changes_no_decision(
    limit: int, gpus: int, events: list[tuple[int, int, str, Any]], asks: list[list[str]]
) -> None:
    """The normal pass is the same with the setting on (its own counts and index beside it)
    as with it off, and with it off the placer decides exactly what the state decides."""
    on, off = fleet(2, gpus, limit), fleet(2, gpus, 0)
    replay(on, events, gpus)
    replay(off, events, gpus)
    placer = quiet_placer(off)
    for i, profiles in enumerate(asks):
        pod = _asking(f"q{i}", profiles)
        req = podlib.pod_request(pod)
        expected = off.decide(req, Policy.INSTASLICE, None)
        assert on.decide(req, Policy.INSTASLICE, None) == expected
        off.upsert_pod(pod)
        on.upsert_pod(pod)
        track = placer.tracks.ensure(f"q{i}")
        placer.decide(f"q{i}")
        if isinstance(expected, Pending):
            assert track.create is None
            continue
        assert track.create is not None
        assert [(s["gpuIndex"], s["start"]) for s in track.create["spec"]["slices"]] == [
            (s.gpu_index, s.start) for s in expected.slices
        ]
        on.assume(track.create)


# --- the flag ------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "expected"), [([], 0), (["--avoid-creates-in-flight", "2"], 2)])
def test_the_flag_sets_the_allocator_setting(argv: list[str], expected: int) -> None:
    settings_ = parse_args(["--no-admission", *argv]).allocator
    assert settings_ is not None and settings_.avoid_creates_in_flight == expected


@pytest.mark.parametrize(("value", "says"), [("-1", "negative"), ("two", "not a whole number")])
def test_a_bad_flag_value_is_refused_naming_the_flag(
    value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--avoid-creates-in-flight", value])
    err = capsys.readouterr().err
    assert "--avoid-creates-in-flight" in err and says in err
