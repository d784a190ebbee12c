"""Ampere mode-change asks that do not outlive their pod (webhook/allocator/maintenance.py
`AskBook`, the placer's `ask_maintenance`, the controller's wiring).

Covers: an ask whose pods all left is withdrawn before the agent's drain starts, and while it
drains, but not once it resets, nor while another parked pod needs it (one that waits for
the change under way too); an opposite change on one GPU waits the interval after the agent's
last change there (on an injected wall clock) and is asked once it has passed, the parked pod
looked at again by the controller's timer; the one ask slot goes round the namespaces
waiting, not to whichever pod is looked at first. The placer runs on the allocator's model
with the asks' writes recorded and shown in the model at once (as their watch events would);
the controller cases use the recording fake API and fake clock of
test_allocator_controller.py; a whole-GPU preemption's ask (MIG off) keeps the interval too
(the setup of test_allocator_preempt_whole.py). Leaves out: a real agent (tests/integration/
test_allocator_with_agent.py runs the asks against the emulator).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from common.catalog import load_catalog
from common.clock import kube_time
from common.placement import PendingReason, Policy
from testkit.builders import GpuSpec, gpu_uuid, make_mig_node, make_node, make_pod
from testkit.clock import FakeClock, settle
from tests.unit.test_allocator_controller import (
    Leader,
    RecordingKube,
    controller,
    leading,
    settings,
)
from tests.unit.test_allocator_preempt_whole import ampere_case
from tests.unit.test_allocator_preempt_whole import decide as decide_whole
from webhook.allocator.controller import Controller
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.placer import Placer
from webhook.allocator.state import ClusterState
from webhook.allocator.track import Tracks

pytestmark = pytest.mark.timeout(10)

A100 = "A100-80GB"  # its 1g.10gb is what make_pod asks for by default
Obj = dict[str, Any]
NEEDS = PendingReason.NEEDS_MIG_MODE_CHANGE.value


def mig_node(gpus: int, desired: dict[str, str], **status: Obj) -> Obj:
    """Node n1's MigNode: `gpus` A100s with MIG off (only a reset changes that), the asks
    `desired` in its spec, and extra status fields per GPU UUID."""
    obj = make_mig_node("n1", [GpuSpec(A100, mig=False)] * gpus)
    for g in obj["status"]["gpus"]:
        g["modeToggle"] = "reset"
        g["computeProcesses"] = 0
        g.update(status.get(g["uuid"], {}))
    obj["spec"] = {"gpus": [{"uuid": u, "desiredMigMode": m} for u, m in desired.items()]}
    return obj


class Cluster:
    """The placer on node n1; asks and withdrawals recorded and shown in the model at once."""

    def __init__(self, gpus: int = 1, interval_s: float = 0.0, **status: Obj) -> None:
        self.gpus, self.status = gpus, status
        self.state = ClusterState()
        self.state.upsert_node(make_node("n1", cpu="64", memory="256Gi", pods=50, gpus=gpus))
        self.desired: dict[str, str] = {}
        self.asked: list[dict[str, str]] = []
        self.withdrawn: list[set[str]] = []
        self.told: dict[str, list[str]] = {}
        self.kicked: list[str] = []
        self.now = 1_000_000.0
        self.placer = Placer(
            self.state,
            Tracks(),
            AllocatorMetrics(),
            Policy.INSTASLICE,
            load_catalog(),
            kick=self.kicked.append,
            tell=lambda pod, reason, message: self.told.setdefault(
                pod["metadata"]["name"], []
            ).append(message),
        )
        self.placer.ampere.ask_modes = self._ask
        self.placer.ampere.withdraw_modes = self._withdraw
        self.placer.ampere.asks.min_interval_s = interval_s
        self.placer.ampere.wall = lambda: self.now
        self.show()

    def show(self) -> None:
        self.state.upsert_mig_node(mig_node(self.gpus, self.desired, **self.status))

    def _ask(self, node: str, wants: dict[str, str]) -> None:
        self.asked.append(wants)
        self.desired.update(wants)
        self.show()

    def _withdraw(self, node: str, uuids: set[str]) -> None:
        self.withdrawn.append(uuids)
        for u in uuids:
            self.desired.pop(u, None)
        self.show()

    def pod(self, name: str, namespace: str = "ns", **kw: Any) -> str:
        self.state.upsert_pod(make_pod(name, uid=name, namespace=namespace, claim=f"c-{name}",
                                       **kw))  # fmt: skip
        self.placer.tracks.ensure(name)
        return name

    def decide(self, uid: str) -> None:
        track = self.placer.tracks.ensure(uid)
        self.placer.tracks.unpark(track)  # as the controller's Queue step does
        self.placer.decide(uid)

    def gone(self, uid: str) -> None:
        """The pod left: what the controller's Forget step does."""
        obj = self.state.pods[uid].obj
        self.state.remove_pod(obj)
        self.placer.tracks.forget(uid)
        self.placer.ampere.release(uid)

    def done(self, uuid: str, mode: str = "enabled") -> None:
        """The agent reached `mode` on `uuid` now; the allocator withdraws the reached ask."""
        self.status[uuid] = {
            "migMode": {"current": mode, "pending": mode},
            "lastModeChange": {"from": "disabled", "to": mode, "time": self.stamp(self.now)},
        }
        self.desired.pop(uuid, None)
        self.placer.ampere.asks.done({uuid})
        self.show()

    @staticmethod
    def stamp(wall: float) -> str:
        return kube_time(dt.datetime.fromtimestamp(wall, dt.UTC))


G0, G1 = gpu_uuid("n1", 0), gpu_uuid("n1", 1)


# --- an ask no parked pod needs is withdrawn --------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "withdrawn"),
    [(None, True), ("Draining", True), ("Resetting", False)],
    ids=["not-started", "draining", "resetting"],
)
def test_an_ask_whose_pod_left_is_withdrawn_before_the_reset(
    phase: str | None, withdrawn: bool
) -> None:
    c = Cluster()
    c.decide(c.pod("p"))
    assert c.asked == [{G0: "enabled"}]
    if phase is not None:
        c.status[G0] = {"modeChange": {"phase": phase}}
        c.show()
    c.gone("p")
    assert c.withdrawn == ([{G0}] if withdrawn else [])
    assert (
        c.placer.ampere.asks.asks == {} and c.placer.ampere.asks.pods == {}
    )  # nothing left behind


def test_an_ask_another_parked_pod_waits_for_stays_until_it_leaves_too() -> None:
    c = Cluster()
    c.decide(c.pod("p"))
    c.decide(c.pod("q"))  # fits once p's change is done: waits for the change under way
    assert c.placer.tracks.ensure("q").told == PendingReason.MIG_MODE_CHANGE_UNDER_WAY.value
    c.gone("p")
    assert c.withdrawn == []  # q still needs it
    c.decide("q")  # looked at again: still waiting for it, still needs it
    assert c.withdrawn == []
    c.gone("q")
    assert c.withdrawn == [{G0}]


def test_an_ask_whose_pod_was_placed_elsewhere_is_withdrawn() -> None:
    """The pod found room without the change (a GPU came back, capacity freed)."""
    c = Cluster(gpus=2)
    c.status[G1] = {"healthy": False}
    c.show()
    c.decide(c.pod("p"))
    assert c.asked == [{G0: "enabled"}]
    c.status[G1] = {"migMode": {"current": "enabled", "pending": "enabled"}}  # MIG on now
    c.show()
    c.decide("p")
    assert c.placer.tracks.ensure("p").create is not None  # placed on GPU 1
    assert c.withdrawn == [{G0}]


# --- opposite changes on one GPU are spaced -----------------------------------------------


def test_an_opposite_change_waits_the_interval_after_the_last_one() -> None:
    c = Cluster(interval_s=600.0)
    c.status[G0] = {"lastModeChange": {"from": "enabled", "to": "disabled",
                                       "time": c.stamp(c.now - 100)}}  # fmt: skip
    c.show()
    c.decide(c.pod("p"))  # wants MIG on, 100 s after the GPU went off
    assert c.asked == []
    assert "less than 600 s ago (--ampere-mode-change-interval)" in c.told["p"][-1]
    assert c.placer.tracks.ensure("p").told == NEEDS
    assert c.placer.ampere.asks.wake == c.now + 500  # when the controller looks again
    assert c.placer.ampere.asks.queue == {}  # held back, not holding the slot from anyone
    c.now += 499
    c.decide("p")
    assert c.asked == []
    c.now += 1
    c.decide("p")
    assert c.asked == [{G0: "enabled"}]


def test_the_same_direction_and_a_zero_interval_are_not_held() -> None:
    c = Cluster(interval_s=600.0)
    c.status[G0] = {"lastModeChange": {"from": "disabled", "to": "enabled",  # then off again
                                       "time": c.stamp(c.now - 1)}}  # fmt: skip
    c.show()  # (MIG is off now: an admin's change since, not ours to space)
    c.decide(c.pod("p"))
    assert c.asked == [{G0: "enabled"}]
    c2 = Cluster(interval_s=0.0)
    c2.status[G0] = {"lastModeChange": {"from": "enabled", "to": "disabled",
                                        "time": c2.stamp(c2.now - 1)}}  # fmt: skip
    c2.show()
    c2.decide(c2.pod("p"))
    assert c2.asked == [{G0: "enabled"}]


async def test_the_controller_looks_again_when_the_interval_has_passed() -> None:
    kube, clock = RecordingKube(), FakeClock()
    c = Controller(
        kube,  # type: ignore[arg-type]
        Leader(),  # type: ignore[arg-type]
        AllocatorMetrics(),
        settings(clock, ampere_mode_changes="drain", ampere_mode_change_interval_s=600.0),
    )
    c.lease_informer.synced.set()
    c.opted_in.add("ns")
    async with leading(c):
        await c.handlers.on_node("ADDED", make_node("n1", gpus=1))
        last = {"from": "enabled", "to": "disabled", "time": kube_time(clock.wall())}
        await c.handlers.on_mig_node("ADDED", mig_node(1, {}, **{G0: {"lastModeChange": last}}))
        await c.handlers.on_pod("ADDED", make_pod("p", uid="p", claim="c-p"))
        await settle()
        assert _mode_writes(kube) == []
        assert "p" in c.tracks.parked  # told why, waiting
        await clock.advance(599)
        assert _mode_writes(kube) == []
        await clock.advance(1)
        await settle()
        assert _mode_writes(kube) == [
            {"spec": {"gpus": [{"uuid": G0, "desiredMigMode": "enabled"}]}}
        ]


# --- the slot goes round the namespaces --------------------------------------------------------


def test_the_free_slot_goes_to_the_namespace_served_longest_ago() -> None:
    """a1 (namespace a) asks; a2 (a) and b1 (b) wait for the slot. When a1's change is done,
    a2 is looked at first (it came first), but the slot is b's: b has never been served."""
    c = Cluster(gpus=3)
    for name, ns in (("a1", "a"), ("a2", "a"), ("b1", "b")):
        c.pod(name, ns, slices={"main": {"7g.80gb": 1}})  # a whole A100 in MIG mode each
    c.decide("a1")
    assert c.asked == [{G0: "enabled"}]
    c.decide("a2")
    c.decide("b1")
    assert "change under way on n1/GPU 0" in c.told["a2"][-1]  # it might fit there too
    assert c.placer.ampere.asks.queue.keys() == {"a", "b"}
    c.done(G0)
    c.decide("a1")  # placed on GPU 0
    assert c.placer.tracks.ensure("a1").create is not None
    c.kicked.clear()
    c.decide("a2")
    assert len(c.asked) == 1, "a2 took the slot before b1"
    assert "namespace b is next" in c.told["a2"][-1]
    assert c.kicked == ["b1"]  # b's pod is looked at again at once
    c.decide("b1")
    assert c.asked[1:] == [{G1: "enabled"}]
    assert c.placer.ampere.asks.served["b"] > c.placer.ampere.asks.served["a"]


def test_a_namespace_that_stops_waiting_passes_the_turn_on() -> None:
    """b1's turn, but b1 left: a2, turned away for it, is looked at again and asks."""
    c = Cluster(gpus=3)
    for name, ns in (("a1", "a"), ("a2", "a"), ("b1", "b")):
        c.pod(name, ns, slices={"main": {"7g.80gb": 1}})
    c.decide("a1")
    c.decide("a2")
    c.decide("b1")
    c.done(G0)
    c.decide("a1")
    c.decide("a2")  # turned away: b's turn
    c.kicked.clear()
    c.gone("b1")
    assert c.kicked == ["a2"]
    c.decide("a2")
    assert c.asked[1:] == [{G1: "enabled"}]


# --- helpers ---------------------------------------------------------------------------------


def _mode_writes(kube: RecordingKube) -> list[Any]:
    return [c[2] for c in kube.writes("patch") if "mignodes" in c[1]]


async def test_a_deleted_pods_ask_is_withdrawn_through_the_controller() -> None:
    """The controller's Forget step releases the pod's asks: its MigNode ask is removed."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    c.placer.ampere.ask_modes = lambda node, wants: c.modes.set(
        node, wants, set()
    )  # as --ampere-mode-changes=drain sets it
    c.placer.ampere.withdraw_modes = lambda node, uuids: c.modes.set(node, {}, uuids)
    pod = make_pod("p", uid="p", claim="c-p")
    async with leading(c):
        await c.handlers.on_node("ADDED", make_node("n1", gpus=1))
        await c.handlers.on_mig_node("ADDED", mig_node(1, {}))
        await c.handlers.on_pod("ADDED", pod)
        await settle()
        asked = {"spec": {"gpus": [{"uuid": G0, "desiredMigMode": "enabled"}]}}
        assert _mode_writes(kube) == [asked]
        await c.handlers.on_mig_node("MODIFIED", mig_node(1, {G0: "enabled"}))  # the ask comes back
        await c.handlers.on_pod("DELETED", pod)
        await settle()
    assert _mode_writes(kube) == [asked, {"spec": {"gpus": []}}]


def test_a_whole_gpu_preemption_does_not_turn_mig_off_within_the_interval() -> None:
    """The other way in: a whole-GPU pod's preemption plan on an A100 in MIG mode asks for
    MIG off with the plan; not within the interval after the GPU went MIG on."""
    state, p, _, asked = ampere_case(hopper_victims=0)
    now = 2_000_000.0
    p.ampere.wall = lambda: now
    p.ampere.asks.min_interval_s = 600.0
    obj = make_mig_node("n1", [GpuSpec("A100-40GB"), GpuSpec("H100-80GB")])
    for g in obj["status"]["gpus"]:
        g["modeToggle"] = "reset" if g["model"].startswith("A") else "resetless"
        g["computeProcesses"] = 2
    last = {"from": "disabled", "to": "enabled", "time": Cluster.stamp(now - 100)}
    obj["status"]["gpus"][0]["lastModeChange"] = last
    state.upsert_mig_node(obj)
    assert decide_whole(p, "train").preempt is None and asked == []
    assert p.ampere.asks.wake == now + 500
    now += 500
    pre = decide_whole(p, "train").preempt
    assert pre is not None and pre.resets == (("n1", 0),)
    assert asked == [("n1", {gpu_uuid("n1", 0): "disabled"})]
