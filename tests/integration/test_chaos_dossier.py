"""The chaos soak's sampler and its dossier of a double booking, against the real API server.

Issue 17: the one-hour soak once found a Running pod whose SliceAllocation was gone while
another allocation held its slots, and nothing recorded could explain it. The sampler
(bench/chaos.py `Sampler`) now keeps the pods' and allocations' timelines and, at the moment
of a violation, writes a dossier (bench/chaos_dossier.py). Here that moment is made by hand
on the local control plane — a pod Running on allocation A, A deleted, B created on A's
slots — and the dossier must hold the fresh pod, both allocations (A gone), the timelines
that show the order of it, the pod's events, and the component and audit log lines that
name them. Leaves out: a real audit log (the session's API server has none; the soak's has,
and a written audit line is parsed here) and the soak itself (test_chaos_quick.py).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.chaos import FULL, Sampler, Workload, _timelines_of
from bench.chaos_dossier import AUDIT_LOG, audit_lines
from bench.invariants import Violation
from common.clock import cancel_until_done
from common.kubeapi import Informer, Kube, Obj, core_path, instaslice_path
from hack.cluster import ControlPlane
from tests.integration.allocator_fixtures import (
    ensure_crds,
    load_crds,
    make_allocation,
    make_pod,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

CRDS = Path(__file__).resolve().parents[2] / "manifests" / "base" / "crds"
NODE = "dossier-nowhere"  # no such Node: nothing but this test touches the pods


@pytest.fixture
async def kube(control_plane: ControlPlane) -> AsyncIterator[Kube]:
    k = await Kube.connect(str(control_plane.kubeconfig))
    async with k:
        await ensure_crds(k, load_crds(CRDS))
        yield k


async def _running(kube: Kube, namespace: str, name: str) -> Obj:
    body = make_pod(name, namespace=namespace, gates=(), node_name=NODE)
    await kube.create(core_path("pods", namespace), body)
    path = core_path("pods", namespace, name) + "/status"
    return await kube.patch(path, {"status": {"phase": "Running"}})


async def test_a_double_booking_comes_with_its_dossier(
    kube: Kube, namespace: str, tmp_path: Path
) -> None:
    work = Workload(kube, random.Random(0), FULL, namespaces=[namespace])
    informer = Informer(kube, core_path("pods", namespace), work.on_pod, name="pods")
    task = asyncio.create_task(informer.run())
    try:
        await informer.synced.wait()
        logs = tmp_path / "logs"
        logs.mkdir()
        sampler = Sampler(kube, work, logs=logs)
        victim = await _running(kube, namespace, "victim")
        taker = await _running(kube, namespace, "taker")
        a = make_allocation(victim, NODE, [("main", "2g.20gb", 0, 0, 2)])
        b = make_allocation(taker, NODE, [("main", "3g.40gb", 0, 0, 4)])
        for obj in (a, b):
            del obj["metadata"]["uid"], obj["metadata"]["finalizers"]
        allocs = instaslice_path("sliceallocations", namespace)
        a = await kube.create(allocs, a)
        uid = victim["metadata"]["uid"]
        for _ in range(50):  # the informer has seen the pod Running
            if work.pods.get(uid, {}).get("status", {}).get("phase") == "Running":
                break
            await asyncio.sleep(0.1)
        await sampler.once()
        assert sampler.violations == {} and sampler.dossiers == []
        # A goes while its pod runs on; B takes its slots
        a_name, b_name = a["metadata"]["name"], b["metadata"]["name"]
        await kube.delete(f"{allocs}/{a_name}")
        b = await kube.create(allocs, b)
        await kube.create(
            core_path("events", namespace),
            {
                "metadata": {"generateName": "victim-"},
                "involvedObject": {
                    "kind": "Pod",
                    "namespace": namespace,
                    "name": "victim",
                    "uid": uid,
                },
                "reason": "SlicesReleased",
                "message": "MIG slices released",
                "type": "Normal",
            },
        )
        (logs / "webhook.log").write_text(
            f'{{"event": "releasing allocation", "allocation": "{namespace}/{a_name}"}}\n'
            '{"event": "something else"}\n'
        )
        audit = {
            "requestReceivedTimestamp": "2026-12-01T18:52:40.000000Z",
            "user": {"username": "system:serviceaccount:kube-system:generic-garbage-collector"},
            "verb": "delete",
            "objectRef": {"resource": "sliceallocations", "namespace": namespace, "name": a_name},
            "responseStatus": {"code": 200},
        }
        (logs / AUDIT_LOG).write_text(json.dumps(audit) + "\n")

        await sampler.once()
        (v,) = sampler.violations.values()
        assert v.detail == f"pod {uid} still runs on these slots"
        (d,) = sampler.dossiers
        pod = d["pods"][uid]
        assert pod["fresh"]["status"]["phase"] == "Running" and not pod["fresh"]["deleting"]
        assert pod["fresh"]["node"] == NODE
        assert pod["timeline"][0]["event"] == "ADDED"
        assert pod["timeline"][-1]["phase"] == "Running"
        gone = d["allocations"][f"{namespace}/{a_name}"]
        assert gone["fresh"] == "gone (404)"
        assert gone["timeline"][0]["slices"] == [f"{a['spec']['slices'][0]['gpuUUID']}[0:2]"]
        assert gone["timeline"][-1]["gone"] is True
        taken = d["allocations"][f"{namespace}/{b_name}"]
        assert taken["fresh"]["uid"] == b["metadata"]["uid"]
        assert taken["timeline"][0]["pod"] == f"taker ({taker['metadata']['uid']})"
        assert any("SlicesReleased" in e for e in d["events"]), d["events"]
        assert d["logs"]["webhook"] == [
            f'{{"event": "releasing allocation", "allocation": "{namespace}/{a_name}"}}'
        ]
        assert d["audit"] == [
            "2026-12-01T18:52:40.000000Z "
            "system:serviceaccount:kube-system:generic-garbage-collector "
            f"delete sliceallocations/{namespace}/{a_name} -> 200"
        ]
        assert json.loads((logs / "double-booking-1.json").read_text()) == d
        await sampler.once()  # the same violation again: counted and explained once
        assert len(sampler.violations) == 1 and len(sampler.dossiers) == 1
        # a pod unsettled at the end comes with its timeline too
        unsettled = Violation("unsettled_pod", f"{namespace}/victim", "Running without ...")
        assert _timelines_of(work, [unsettled]) == {f"{namespace}/victim": pod["timeline"]}
    finally:
        await cancel_until_done([task])
        for name in ("victim", "taker"):
            await kube.delete_ignore_missing(core_path("pods", namespace, name),
                                             gracePeriodSeconds=0)  # fmt: skip


def test_audit_lines_keep_the_latest_naming_the_objects(tmp_path: Path) -> None:
    path = tmp_path / AUDIT_LOG
    entry = {"verb": "patch", "user": {"username": "u"}, "responseStatus": {"code": 200},
             "requestReceivedTimestamp": "t", "requestObject": [{"op": "replace"}]}  # fmt: skip
    lines = [
        json.dumps({**entry, "objectRef": {"resource": "pods", "namespace": "ns", "name": n}})
        for n in ("pod-one", "pod-two", "pod-one")
    ]
    path.write_text("\n".join([*lines, "not json pod-one"]) + "\n")
    got = audit_lines(path, ["pod-one"], limit=1)
    assert got == ['t u patch pods/ns/pod-one -> 200 body=[{"op": "replace"}]']
    assert len(audit_lines(path, ["pod-one"])) == 2
    assert audit_lines(path, []) == [] == audit_lines(tmp_path / "none", ["pod-one"])
