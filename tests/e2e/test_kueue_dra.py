"""Kueue v0.17 and InstaSlice in DRA mode (`dra: true`, `kueue: true`, `slotAccounting: true`):
what works, on the real Kueue manager (docs/kueue.md "DRA mode").

Covers: plain pods asking `nvidia.com/mig-*` in an opted-in namespace, queued to a ClusterQueue
whose quota is `instaslice.io/memory-slots`: Kueue admits them by the memory slots the webhook
still adds in DRA mode (the MIG extended resources are gone: the pod names its ResourceClaim),
InstaSlice then places them and allocates their claims, and a pod beyond the slot quota stays
held by Kueue, with InstaSlice never touching it. Kueue's own DRA accounting
(`deviceClassMappings`, its alpha `DynamicResourceAllocation` gate) is not used: v0.17.0 marks a
workload whose pods name a ResourceClaim (not a template) inadmissible (docs/kueue.md).
Leaves out: Jobs (the same pods), preemption and cohorts.
"""

from __future__ import annotations

from typing import Any

import pytest

from common.constants import CLAIM_ANNOTATION, ENABLED_KEY, GATE_NAME, MEMORY_SLOTS_RESOURCE
from common.kubeapi import Kube, Obj, core_path, group_path
from testkit.builders import user_pod
from tests.e2e.helpers import pods_path, wait_opted_in
from tests.e2e.test_kueue import KUEUE, KUEUE_GATE, QUEUE_LABEL, _flavor, cluster_queue
from tests.support import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

OWN_SPEC: dict[str, Any] = {
    "dra": True,
    "kueue": True,
    "slotAccounting": True,
    "nodes": [{"prefix": "kd", "count": 1, "gpus": 1, "model": "H100-80GB", "cpu": "8"}],
}


def claims_path(ns: str, name: str | None = None) -> str:
    return group_path("resource.k8s.io/v1", "resourceclaims", ns, name)


async def test_memory_slot_quota_admits_dra_pods(own_kube: Kube) -> None:
    kube = own_kube
    await kube.create(group_path(KUEUE, "resourceflavors"), _flavor("any", {}))
    await kube.create(
        group_path(KUEUE, "clusterqueues"),
        cluster_queue("cq-dra", {"any": {MEMORY_SLOTS_RESOURCE: 3}}),
    )
    ns = (
        await kube.create(
            core_path("namespaces"),
            {"metadata": {"generateName": "kd-", "annotations": {ENABLED_KEY: "true"}}},
        )
    )["metadata"]["name"]
    await wait_for(kube, core_path("serviceaccounts", ns), lambda s: "default" in s, what="SA")
    await wait_opted_in(kube, ns)
    lq = {"apiVersion": KUEUE, "kind": "LocalQueue", "metadata": {"name": "q"},
          "spec": {"clusterQueue": "cq-dra"}}  # fmt: skip
    await kube.create(group_path(KUEUE, "localqueues", ns), lq)
    for name, profile in (("k1", "1g.10gb"), ("k2", "2g.20gb"), ("k3", "1g.10gb")):
        pod = user_pod(name=name, slices={"main": {profile: 1}}, labels={QUEUE_LABEL: "q"})
        await kube.create(pods_path(ns), pod)

    def placed(pods: dict[str, Obj]) -> dict[str, Obj] | None:
        up = {n: p for n, p in pods.items() if p.get("status", {}).get("phase") == "Running"}
        return up if set(up) == {"k1", "k2"} else None

    running = await wait_for(kube, pods_path(ns), placed, what="k1 and k2 Running")
    for pod in running.values():
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert not [k for k in limits if k.startswith(("nvidia.com/mig", "instaslice.io/mig"))]
        claim = await kube.get(claims_path(ns, pod["metadata"]["annotations"][CLAIM_ANNOTATION]))
        assert claim["status"]["allocation"]["devices"]["results"]
    held = await kube.get(pods_path(ns, "k3"))
    gates = [g["name"] for g in held["spec"].get("schedulingGates") or []]
    assert KUEUE_GATE in gates and GATE_NAME in gates, gates  # Kueue holds it: beyond 3 slots
    assert not (await kube.list(claims_path(ns)))["items"][2:]  # none made for k3
    await kube.delete_ignore_missing(core_path("namespaces", name=ns))
