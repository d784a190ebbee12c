"""The allocator in DRA mode against the real local control plane (v1.37.2: kube-apiserver,
kube-scheduler, the resourceclaim controller, KWOK nodes), the node's pool published as the
node agent publishes it (nodeagent.dra.pool), pods created as DRA-mode admission leaves them.

Covers: the allocator creates each pod's ResourceClaim (owner = the pod, finalizer
`instaslice.io/release`, one request per ask), writes its allocation (devices of our pool, the
node selector) and reservation in one status update, takes the gate off with no pin, and
kube-scheduler binds the pod there; several asks in one pod; `SliceAllocated` on the pod, as
in gate mode; a deleted pod's claim is released (deleted; the finalizer is the node agent's);
users' own claims, allocated by kube-scheduler, are counted before placing; the allocator and
kube-scheduler allocating on the same GPU in a seeded random interleaving never leave two
claims on one slot (a race is answered by InstaSlice's claim yielding).
Leaves out: the node agent (tests/e2e/test_dra.py runs it), the kubelet (KWOK has none).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml

from common.catalog import load_catalog
from common.constants import (
    CLAIM_ANNOTATION,
    DRA_DRIVER,
    REASON_ALLOCATED,
    RELEASE_FINALIZER,
    AllocationMode,
)
from common.draclaim import parse_device
from common.kubeapi import ApiError, Kube, Obj, core_path, group_path
from nodeagent.dra.pool import pool_slices, slice_body
from nodeagent.dra.publish import slice_name, slices_path
from nodeagent.emulator import EmulatedNvml, provision
from nodeagent.nvml import NvmlSession
from testkit.builders import user_pod
from tests.integration.allocator_fixtures import AllocatorEnv, allocator_env, kube
from tests.support import listed, wait_for
from webhook.admission import review
from webhook.allocator import pods as podlib
from webhook.reviews import Patched
from webhook.settings import AdmissionSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
__all__ = ["kube"]

ROOT = Path(__file__).resolve().parents[2]
H100 = "H100-80GB"
CATALOG = load_catalog()
ADMISSION = AdmissionSettings.from_catalog(allocation_mode=AllocationMode.DRA)


def claims_path(namespace: str, name: str | None = None) -> str:
    return group_path("resource.k8s.io/v1", "resourceclaims", namespace, name)


@contextlib.contextmanager
def _inventory(model: str) -> Iterator[Any]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        provision(Path(d), "n", [model], "enabled")
        s = NvmlSession(EmulatedNvml(Path(d), "n"), CATALOG)
        s.open()
        try:
            yield s.inventory()
        finally:
            s.close()


async def publish_pool(kube: Kube, node: str, model: str = H100) -> None:
    """The node's ResourceSlices as its agent publishes them (MIG mode on, no whole GPU)."""
    with _inventory(model) as inv:
        parts = pool_slices(inv, {}, lambda g: True, lambda g: False)
    for p in parts:
        body = slice_body(node, slice_name(node, p.part), p, 1, len(parts))
        await kube.create(slices_path(), body)


async def device_classes(kube: Kube) -> None:
    path = group_path("resource.k8s.io/v1", "deviceclasses")
    for doc in yaml.safe_load_all(
        (ROOT / "manifests/components/dra/deviceclasses.yaml").read_text()
    ):
        with contextlib.suppress(ApiError):
            await kube.create(path, doc)


@pytest.fixture
async def env(kube: Kube, namespace: str) -> AsyncIterator[AllocatorEnv]:
    await device_classes(kube)
    nodes: list[str] = []
    try:
        async with allocator_env(kube, namespace) as world:
            nodes = world.nodes
            yield world
    finally:  # the pods are gone: the claims lose the finalizer no agent drops here
        for c in (await kube.list(claims_path(namespace))).get("items", []):
            if c["metadata"].get("finalizers"):
                path = claims_path(namespace, c["metadata"]["name"])
                with contextlib.suppress(ApiError):
                    await kube.patch(path, {"metadata": {"finalizers": None}})
        for node in nodes:
            got = await kube.list(slices_path(), fieldSelector=f"spec.nodeName={node}")
            for s in got.get("items", []):
                await kube.delete_ignore_missing(slices_path(s["metadata"]["name"]))


async def dra_node(env: AllocatorEnv, short: str) -> str:
    node = await env.add_node(short, model=H100)
    await publish_pool(env.kube, node)
    return node


async def create_dra_pod(env: AllocatorEnv, name: str, slices: dict[str, dict[str, int]]) -> Obj:
    """A pod as DRA-mode admission leaves it (the webhook's own review, applied)."""
    pod = user_pod(name=name, namespace=env.namespace, slices=slices)
    request = {
        "uid": "x",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "operation": "CREATE",
        "namespace": env.namespace,
        "object": pod,
    }
    d = review(request, ADMISSION, new_claim=lambda: f"c{secrets.token_hex(8)}")  # type: ignore[arg-type]
    assert isinstance(d, Patched), d
    body = jsonpatch.apply_patch(pod, d.patch)
    return await env.kube.create(core_path("pods", env.namespace), body)


async def create_user_claim_pod(env: AllocatorEnv, name: str, profile: str) -> None:
    """A user's own claim (`mig.instaslice.io`, CEL on profile) and a pod using it, in a
    namespace InstaSlice serves: kube-scheduler allocates it."""
    cel = f'device.attributes["{DRA_DRIVER}"].profile == "{profile}"'
    claim = {
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {
            "deviceClassName": "mig.instaslice.io", "selectors": [{"cel": {"expression": cel}}],
        }}]}},
    }  # fmt: skip
    await env.kube.create(claims_path(env.namespace), claim)
    main = {"name": "main", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}
    pod = {
        "metadata": {"name": name, "namespace": env.namespace},
        "spec": {
            "nodeSelector": {"allocator-test.instaslice.io/namespace": env.namespace},
            "tolerations": [{"operator": "Exists"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            "containers": [main],
        },
    }
    await env.kube.create(core_path("pods", env.namespace), pod)


async def claims(env: AllocatorEnv) -> list[Obj]:
    return list((await env.kube.list(claims_path(env.namespace))).get("items", []))


def allocated(claim: Obj) -> list[tuple[str, str]]:
    alloc = (claim.get("status") or {}).get("allocation") or {}
    return [(r["pool"], r["device"]) for r in alloc.get("devices", {}).get("results", [])]


def assert_no_double_booking(items: list[Obj]) -> None:
    """No memory slot of any GPU is in two allocated claims (devices read as placements)."""
    model = CATALOG.model(H100)
    assert model is not None
    held: dict[tuple[str, int], tuple[str, int]] = {}
    for c in items:
        for pool, device in allocated(c):
            parsed = parse_device(device)
            assert parsed is not None, device
            gpu, pid, start = parsed
            p = model.profile_by_id(pid) if pid is not None else None
            size = p.memory_slots if p is not None else model.memory_slots
            mask = ((1 << size) - 1) << start
            key = (pool, gpu)
            name, was = held.get(key, ("", 0))
            assert not was & mask, f"{device} of {c['metadata']['name']} overlaps {name}'s"
            held[key] = (c["metadata"]["name"], was | mask)


async def test_pod_gets_a_claim_allocated_and_reserved_then_ungated(env: AllocatorEnv) -> None:
    node = await dra_node(env, "n0")
    env.start(allocation_mode=AllocationMode.DRA)
    await create_dra_pod(env, "one", {"main": {"1g.10gb": 1}})
    await create_dra_pod(env, "two", {"a": {"2g.20gb": 1, "1g.10gb": 2}, "b": {"1g.20gb": 1}})
    for name in ("one", "two"):
        pod = await env.wait_bound(name)
        assert pod["spec"]["nodeName"] == node
        assert podlib.pinned_node(pod) is None  # no pin: the claim's node selector binds it
        claim_name = pod["metadata"]["annotations"][CLAIM_ANNOTATION]
        claim = await env.kube.get(claims_path(env.namespace, claim_name))
        meta, status = claim["metadata"], claim["status"]
        assert meta["finalizers"] == [RELEASE_FINALIZER]
        assert [(o["kind"], o["uid"]) for o in meta["ownerReferences"]] == [
            ("Pod", pod["metadata"]["uid"])
        ]
        assert status["reservedFor"] == [
            {"resource": "pods", "name": name, "uid": pod["metadata"]["uid"]}
        ]
        terms = status["allocation"]["nodeSelector"]["nodeSelectorTerms"]
        assert terms == [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        ]
        requests = {r["name"] for r in claim["spec"]["devices"]["requests"]}
        for c in pod["spec"]["containers"]:
            for ref in c["resources"].get("claims", []):
                assert ref["request"] in requests
        results = status["allocation"]["devices"]["results"]
        assert all(r["driver"] == DRA_DRIVER and r["pool"] == node for r in results)
        await env.wait_event(name, REASON_ALLOCATED)
    two = await env.pod("two")
    claim_two = await env.kube.get(
        claims_path(env.namespace, two["metadata"]["annotations"][CLAIM_ANNOTATION])
    )
    assert len(claim_two["status"]["allocation"]["devices"]["results"]) == 4
    assert_no_double_booking(await claims(env))

    await env.delete_pod("one")  # released: deleted, held by the agent's finalizer
    await wait_for(
        env.kube,
        claims_path(env.namespace),
        listed(lambda items: len(items) == 2 and sum(
            bool(c["metadata"].get("deletionTimestamp")) for c in items) == 1),
        what="the deleted pod's claim being deleted",
    )  # fmt: skip


async def test_users_claims_are_counted_before_placing(env: AllocatorEnv) -> None:
    await dra_node(env, "n0")
    # the user's 3g.40gb claim, allocated by kube-scheduler at start 4 (InstaSlice's order)
    await create_user_claim_pod(env, "mine", "3g.40gb")
    await env.wait_bound("mine")
    env.start(allocation_mode=AllocationMode.DRA)
    # four 1g.10gb fit beside it (starts 0-3); the fifth does not
    for i in range(5):
        await create_dra_pod(env, f"p{i}", {"main": {"1g.10gb": 1}})
    await env.wait_event("p4", "AllocationPending", within=60)
    items = await wait_for(
        env.kube,
        claims_path(env.namespace),
        listed(lambda items: items if sum(bool(allocated(c)) for c in items) == 5 else None),
        what="the user's claim and four of ours allocated",
    )
    assert_no_double_booking(items)
    assert podlib.has_our_gate(await env.pod("p4"))


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_allocator_and_scheduler_racing_never_double_book(
    env: AllocatorEnv, seed: int
) -> None:
    """Users' claims and InstaSlice's pods created in a seeded random order, at once, on one
    GPU they cannot all fit: whatever the interleaving, once the dust settles no slot is in
    two allocated claims."""
    await dra_node(env, "n0")
    env.start(allocation_mode=AllocationMode.DRA)
    rng = random.Random(seed)
    work = [("user", f"u{i}", rng.choice(["1g.10gb", "2g.20gb"])) for i in range(4)]
    work += [("ours", f"o{i}", rng.choice(["1g.10gb", "2g.20gb"])) for i in range(5)]
    rng.shuffle(work)

    async def one(kind: str, name: str, profile: str) -> None:
        await asyncio.sleep(rng.random() * 0.05)  # spread the creates (no assertion waits)
        if kind == "user":
            await create_user_claim_pod(env, name, profile)
        else:
            await create_dra_pod(env, name, {"main": {profile: 1}})

    await asyncio.gather(*(one(*w) for w in work))

    def settled(items: list[Obj]) -> bool:
        live = [c for c in items if allocated(c) and not c["metadata"].get("deletionTimestamp")]
        try:
            assert_no_double_booking(live)
        except AssertionError:
            return False
        return len(live) >= 4  # the GPU's 7 compute slices are used by at least 4

    await wait_for(env.kube, claims_path(env.namespace), listed(settled), within=90,
                   what="allocated claims without a shared slot")  # fmt: skip


async def test_a_race_lost_to_the_scheduler_is_yielded(env: AllocatorEnv) -> None:
    """kube-scheduler read our claim late and gave a user's claim the same device (written
    here as it would: the race made certain). InstaSlice's claim yields: its pod, ungated and
    bound, is deleted as read (a controller recreates it) and its claim released."""
    await dra_node(env, "n0")
    env.start(allocation_mode=AllocationMode.DRA)
    await create_dra_pod(env, "ours", {"main": {"1g.10gb": 1}})
    pod = await env.wait_bound("ours")
    ours = await env.kube.get(
        claims_path(env.namespace, pod["metadata"]["annotations"][CLAIM_ANNOTATION])
    )
    (result,) = ours["status"]["allocation"]["devices"]["results"]
    theirs = await env.kube.create(
        claims_path(env.namespace),
        {"metadata": {"name": "theirs"}, "spec": {"devices": {"requests": [
            {"name": "r", "exactly": {"deviceClassName": "mig.instaslice.io"}}]}}},
    )  # fmt: skip
    theirs["status"] = {
        "allocation": {
            "devices": {"results": [{**result, "request": "r"}]},
            "nodeSelector": ours["status"]["allocation"]["nodeSelector"],
        }
    }
    await env.kube.replace(claims_path(env.namespace, "theirs") + "/status", theirs)
    await env.wait_gone("ours")
    await env.wait_event("ours", "SliceLost", saying="theirs")
    await wait_for(
        env.kube,
        claims_path(env.namespace),
        listed(lambda items: all(
            c["metadata"]["name"] == "theirs" or c["metadata"].get("deletionTimestamp")
            for c in items)),
        what="our claim released",
    )  # fmt: skip
