"""The placer's whole-GPU preemption (webhook/allocator/planning.py `Planner`,
preemption.whole_candidates, views.whole_if_idle), on the allocator's model: a whole-GPU pod
that finds every GPU busy plans to evict exactly the lower-priority holders of one GPU and
reserves that GPU whole (so no MIG pod is placed there while they go); a GPU with a foreign
instance, a higher-priority holder, or one that needs a reset (Ampere) while the Ampere
maintenance is off, is never planned on, and then the pod is told why; with the maintenance
on, an Ampere GPU is planned on only when no reset-less GPU will do and no change is in
flight, and its change to MIG off is asked with the plan; preemptionPolicy Never plans
nothing. The planner itself: test_preempt_whole.py; the steps
after the plan (evict, await, create): tests/integration/test_allocator_preemption.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from common.catalog import load_catalog
from common.constants import KIND_GPU, REASON_PENDING
from common.placement import Policy
from testkit.builders import GpuSpec, gpu_uuid, make_allocation, make_mig_node, make_node, make_pod
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.placer import Placer
from webhook.allocator.preemption import Budgets, PreemptionSettings
from webhook.allocator.state import ClusterState
from webhook.allocator.track import PodTrack, Tracks
from webhook.allocator.views import whole_if_idle

pytestmark = pytest.mark.timeout(10)

H100, A100 = "H100-80GB", "A100-40GB"
Obj = dict[str, Any]


def cluster(models: list[str], foreign_on: int | None = None) -> ClusterState:
    """Node n1, every GPU in MIG mode (H100s turn it off without a reset, A100s only with
    one); `foreign_on`: that GPU also holds a 1g at slot 6 InstaSlice did not make."""
    mig_node = make_mig_node("n1", [GpuSpec(m) for m in models])
    for g in mig_node["status"]["gpus"]:
        g["modeToggle"] = "reset" if g["model"].startswith("A") else "resetless"
        g["computeProcesses"] = 2  # the holders' work: gone with them
        if g["index"] == foreign_on:
            g["slices"] = [{"profile": "1g.10gb", "start": 6, "size": 1, "migUUID": "MIG-x"}]
    state = ClusterState()
    state.upsert_node(make_node("n1", cpu="64", memory="256Gi", pods=50, gpus=len(models)))
    state.upsert_mig_node(mig_node)
    return state


def hold(state: ClusterState, name: str, gpu: int, start: int, profile: str, prio: int) -> None:
    model = load_catalog().model(H100 if "10gb" in profile or "40gb" in profile else A100)
    assert model is not None
    size = next(x.memory_slots for x in model.profiles if x.name == profile)
    obj = make_pod(name, uid=name, priority=prio, gates=(), node_name="n1", phase="Running",
                   slices={"main": {profile: 1}})  # fmt: skip
    state.upsert_pod(obj)
    state.upsert_allocation(make_allocation(obj, "n1", [("main", profile, gpu, start, size)]))


def placer(state: ClusterState) -> tuple[Placer, list[tuple[str, str, str]]]:
    """A placer with preemption on, and the (pod, reason, message) it tells."""
    told: list[tuple[str, str, str]] = []
    p = Placer(
        state,
        Tracks(),
        AllocatorMetrics(),
        Policy.INSTASLICE,
        load_catalog(),
        kick=lambda uid: None,
        tell=lambda pod, reason, message: told.append((pod["metadata"]["name"], reason, message)),
    )
    p.preemption = PreemptionSettings(Budgets(), kueue_ok=False, wait_s=60, now=lambda: 0)
    return p, told


def decide(p: Placer, uid: str) -> PodTrack:
    p.tracks.ensure(uid)
    p.decide(uid)
    track = p.tracks.get(uid)
    assert track is not None
    return track


def want(state: ClusterState, name: str = "train", n: int = 1, **kw: Any) -> Obj:
    obj = make_pod(name, uid=name, priority=10, slices={"main": {"gpu": n}}, **kw)
    state.upsert_pod(obj)
    return obj


def busy_pair(state: ClusterState) -> None:
    """GPU 0: a low-priority 4g and 3g; GPU 1: a low 4g and a 3g of equal priority (10)."""
    hold(state, "lo-a", 0, 0, "4g.40gb", prio=1)
    hold(state, "lo-b", 0, 4, "3g.40gb", prio=1)
    hold(state, "lo-c", 1, 0, "4g.40gb", prio=1)
    hold(state, "peer", 1, 4, "3g.40gb", prio=10)


def test_a_whole_gpu_pod_evicts_the_lower_priority_holders_of_one_gpu_and_reserves_it() -> None:
    state = cluster([H100, H100])
    busy_pair(state)
    want(state)
    p, told = placer(state)
    track = decide(p, "train")
    assert track.preempt is not None and told == []
    assert sorted(v.name for v in track.preempt.victims) == ["lo-a", "lo-b"]
    (spec,) = track.preempt.body["spec"]["slices"]
    assert (spec["gpuIndex"], spec["start"], spec["size"], spec["kind"]) == (0, 0, 8, KIND_GPU)
    # reserved: GPU 0 shows full, so a new MIG pod (of any priority) is not placed there
    assert state.snapshot().nodes[0].gpus[0].mask == 0xFF
    small = make_pod("small", uid="small", priority=0, slices={"main": {"1g.10gb": 1}})
    state.upsert_pod(small)
    assert decide(p, "small").create is None
    assert told[-1][:2] == ("small", REASON_PENDING)


@pytest.mark.parametrize(
    ("models", "foreign_on"),
    [
        ([H100, H100], 0),  # GPU 0 holds a foreign instance; GPU 1 a pod of equal priority
        ([A100, H100], None),  # GPU 0 (Ampere) would need a reset to turn MIG off
    ],
)
def test_no_gpu_to_empty_leaves_the_pod_pending_and_says_why(
    models: list[str], foreign_on: int | None
) -> None:
    state = cluster(models, foreign_on)
    small, big = ("1g.5gb", "4g.20gb") if models[0] == A100 else ("1g.10gb", "4g.40gb")
    hold(state, "lo-a", 0, 0, big, prio=1)
    hold(state, "lo-b", 0, 4, small, prio=1)
    hold(state, "lo-c", 1, 0, "4g.40gb", prio=1)
    hold(state, "peer", 1, 4, "3g.40gb", prio=10)
    want(state)
    p, told = placer(state)
    track = decide(p, "train")
    assert track.preempt is None
    ((name, reason, message),) = told
    assert (name, reason) == ("train", REASON_PENDING)
    assert message.endswith("preemption: no set of lower-priority pods frees a placement for it")


def test_preemption_policy_never_plans_nothing() -> None:
    state = cluster([H100, H100])
    busy_pair(state)
    obj = want(state)
    obj["spec"]["preemptionPolicy"] = "Never"
    state.upsert_pod(obj)
    p, told = placer(state)
    assert decide(p, "train").preempt is None
    assert told[0][2].endswith("its preemptionPolicy is Never: it preempts no pod")


def test_two_whole_gpus_evict_on_one_node_only() -> None:
    state = cluster([H100, H100, H100])
    hold(state, "lo-a", 0, 0, "4g.40gb", prio=1)
    hold(state, "lo-b", 1, 0, "4g.40gb", prio=1)
    hold(state, "hi", 2, 0, "4g.40gb", prio=50)
    want(state, n=2)
    pre = decide(placer(state)[0], "train").preempt
    assert pre is not None and sorted(v.name for v in pre.victims) == ["lo-a", "lo-b"]
    assert sorted(s["gpuIndex"] for s in pre.body["spec"]["slices"]) == [0, 1]


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        (
            {
                "migMode": {"current": "enabled", "pending": "enabled"},
                "modeToggle": "resetless",
                "computeProcesses": 3,  # the holders' work: ignored
            },
            "resetless",
        ),
        ({"migMode": {"current": "disabled", "pending": "disabled"}, "modeToggle": "reset"}, "off"),
        ({"migMode": {"current": "enabled", "pending": "enabled"}, "modeToggle": "reset"}, "reset"),
        ({"migMode": {"current": "enabled", "pending": "enabled"}, "modeToggle": "none"}, ""),
        (
            {
                "migMode": {"current": "enabled", "pending": "enabled"},
                "modeToggle": "resetless",
                "modeChange": {"phase": "Changing"},
            },
            "",
        ),
        (
            {"migMode": {"current": "enabled", "pending": "disabled"}, "modeToggle": "resetless"},
            "",
        ),
    ],
)
def test_whole_if_idle_ignores_processes_but_not_a_change_under_way(
    entry: Obj, expected: str
) -> None:
    assert whole_if_idle({**entry, "healthy": True}) == expected
    assert whole_if_idle({**entry, "healthy": False}) == ""


# --- Ampere: only with the maintenance on, only when no reset-less GPU will do -------------


Asked = list[tuple[str, dict[str, str]]]


def ampere_case(
    hopper_victims: int,
) -> tuple[ClusterState, Placer, list[tuple[str, str, str]], Asked]:
    """GPU 0 (A100): one low 4g; GPU 1 (H100): `hopper_victims` low pods (0: a peer of
    equal priority, so GPU 1 is out); the whole-GPU pod "train"; a placer whose maintenance
    asks are recorded."""
    state = cluster([A100, H100])
    hold(state, "amp", 0, 0, "4g.20gb", prio=1)
    if hopper_victims:
        hold(state, "hop-a", 1, 0, "4g.40gb", prio=1)
        hold(state, "hop-b", 1, 4, "3g.40gb", prio=1)
    else:
        hold(state, "peer", 1, 0, "4g.40gb", prio=10)
    want(state)
    p, told = placer(state)
    asked: Asked = []
    p.ampere.ask_modes = lambda node, wants: asked.append((node, wants))
    return state, p, told, asked


def test_with_the_maintenance_on_an_ampere_gpu_is_planned_and_its_reset_asked() -> None:
    _, p, told, asked = ampere_case(hopper_victims=0)
    pre = decide(p, "train").preempt
    assert pre is not None and [v.name for v in pre.victims] == ["amp"] and told == []
    assert pre.resets == (("n1", 0),)
    assert asked == [("n1", {gpu_uuid("n1", 0): "disabled"})]


def test_a_resetless_gpu_wins_over_a_cheaper_ampere_one() -> None:
    _, p, _, asked = ampere_case(hopper_victims=2)
    pre = decide(p, "train").preempt
    assert pre is not None and sorted(v.name for v in pre.victims) == ["hop-a", "hop-b"]
    assert pre.resets == () and asked == []


def test_no_ampere_plan_while_a_mode_change_is_in_flight() -> None:
    state, p, told, asked = ampere_case(hopper_victims=0)
    mig_node = make_mig_node("n2", [GpuSpec(A100, mig=False)])
    mig_node["spec"] = {"gpus": [{"uuid": gpu_uuid("n2", 0), "desiredMigMode": "enabled"}]}
    state.upsert_node(make_node("n2", cpu="8", memory="32Gi", pods=10, gpus=1))
    state.upsert_mig_node(mig_node)
    assert decide(p, "train").preempt is None and asked == []
    assert told[0][2].endswith(
        "preemption: no set of lower-priority pods frees a GPU whose MIG mode goes off without "
        "a reset; a plan with a reset waits for the change under way on n2/GPU 0 (Ampere "
        "maintenance)"
    )
