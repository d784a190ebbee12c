"""What the webhook/allocator process keeps per node (docs/configuration.md, memory).

Covers: the allocator's Node and MigNode informers keep each object's identity only (the
objects are parsed into `ClusterState`), list MigNodes in pages of MIG_NODE_PAGE_SIZE, and
a node or MigNode gone during a watch gap still leaves the state by that identity; its
Lease informer keeps Leases without managedFields; admission's offered profiles, now
counted per name instead of re-unioned over every node on each change, stay the union of
what the nodes last published (a hypothesis run of updates). The Informer's own `keep`
behaviour against a real API server: tests/integration/test_informer.py. The memory itself
is a benchmark's (`python -m bench.fleet_memory`), never asserted here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

from hypothesis import given
from hypothesis import strategies as st

from common.constants import MIG_NODE_PAGE_SIZE
from common.kubeapi import Informer, Kube, Obj
from testkit.builders import make_mig_node, make_node
from testkit.clock import FakeClock
from tests.unit.test_allocator_controller import Leader, RecordingKube, settings
from webhook.allocator.controller import Controller
from webhook.allocator.leader import LeaderElector
from webhook.allocator.metrics import AllocatorMetrics
from webhook.offered import OfferedProfiles

IDENTITY_KEYS = {"apiVersion", "kind", "metadata"}


class ListingKube(RecordingKube):
    """Serves lists of `listed[path]` (each object given a uid and resourceVersion), paged."""

    def __init__(self) -> None:
        super().__init__()
        self.listed: dict[str, list[Obj]] = {}
        self.pages: dict[str, list[int]] = {}

    async def list_pages(self, path: str, limit: int, **query: Any) -> AsyncIterator[Obj]:
        items = self.listed.get(path, [])
        for start in range(0, max(1, len(items)), limit):
            page = [
                {**o, "metadata": {**o["metadata"], "uid": "u-" + o["metadata"]["name"],
                                   "resourceVersion": "1"}}
                for o in items[start : start + limit]
            ]  # fmt: skip
            self.pages.setdefault(path, []).append(len(page))
            yield {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                   "items": page}  # fmt: skip


def _informer(c: Controller, name: str) -> Informer:
    return next(i for i in c.informers if i.name == name)


def _controller(kube: ListingKube) -> Controller:
    return Controller(
        cast(Kube, kube),
        cast(LeaderElector, Leader()),
        AllocatorMetrics(),
        settings(FakeClock()),
    )


async def test_nodes_and_mig_nodes_are_parsed_and_only_their_identity_cached() -> None:
    kube = ListingKube()
    c = _controller(kube)
    nodes, mig_nodes = _informer(c, "nodes"), _informer(c, "mignodes")
    names = [f"n{i}" for i in range(MIG_NODE_PAGE_SIZE + 3)]
    kube.listed[nodes.path] = [make_node(n, gpus=2) for n in names]
    kube.listed[mig_nodes.path] = [make_mig_node(n, ["H100-80GB"] * 2) for n in names]
    await nodes._relist()
    await mig_nodes._relist()

    assert kube.pages[mig_nodes.path] == [MIG_NODE_PAGE_SIZE, 3]
    for informer in (nodes, mig_nodes):
        assert set(informer.cache) == set(names)
        assert all(set(o) == IDENTITY_KEYS for o in informer.cache.values())
        assert informer.cache["n0"]["metadata"] == {
            "name": "n0", "uid": "u-n0", "resourceVersion": "1"
        }  # fmt: skip
    assert [s.name for s in c.state.node_states()] == sorted(names)
    assert all(len(s.gpus) == 2 for s in c.state.node_states())
    assert c.state.free("n0").cpu_millis == 8000  # the Node's allocatable, parsed

    # A watch gap: n1's node and n2's MigNode went; the re-list finds them gone from the
    # identities alone, and the state lets them go.
    kube.listed[nodes.path] = [o for o in kube.listed[nodes.path] if o["metadata"]["name"] != "n1"]
    kube.listed[mig_nodes.path] = [
        o for o in kube.listed[mig_nodes.path] if o["metadata"]["name"] != "n2"
    ]
    await nodes._relist()
    await mig_nodes._relist()
    assert "n1" not in c.state.nodes and "n2" not in c.state.gpus
    states = {s.name for s in c.state.node_states()}
    assert states == set(names) - {"n1", "n2"}


async def test_agent_leases_are_cached_without_managed_fields() -> None:
    kube = ListingKube()
    c = _controller(kube)
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "n0", "namespace": "instaslice-system",
                     "managedFields": [{"manager": "instaslice-nodeagent"}]},
        "spec": {"holderIdentity": "instaslice-nodeagent/n0", "leaseDurationSeconds": 40,
                 "renewTime": "2026-12-01T10:00:00.000000Z"},
    }  # fmt: skip
    kube.listed[c.lease_informer.path] = [lease]
    await c.lease_informer._relist()
    (cached,) = c.lease_informer.cache.values()
    assert "managedFields" not in cached["metadata"]
    assert cached["spec"] == lease["spec"]  # what the agent watch reads, DELETED included


PROFILES = ["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb", "9g.90gb"]
# (node, its published profiles, or None: its MigNode deleted)
UPDATES = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.none() | st.frozensets(st.sampled_from(PROFILES)),
    ),
    max_size=30,
)


def _mig_node(name: str, profiles: frozenset[str]) -> Obj:
    gpus = [{"index": 0, "profiles": [{"name": p} for p in sorted(profiles)]}]
    return {"metadata": {"name": name}, "status": {"gpus": gpus}}


@given(UPDATES)
def test_offered_profiles_are_the_union_of_what_each_node_last_published(
    updates: list[tuple[str, frozenset[str] | None]],
) -> None:
    catalog = frozenset({"1g.10gb", "7g.80gb"})
    offered = OfferedProfiles(catalog)
    last: dict[str, frozenset[str]] = {}
    for node, profiles in updates:
        if profiles is None:
            offered.update("DELETED", {"metadata": {"name": node}})  # a re-list's identity
            last.pop(node, None)
        else:
            offered.update("MODIFIED", _mig_node(node, profiles))
            last[node] = profiles
        union = frozenset().union(*last.values())
        assert offered.cluster == union
        assert offered.known == catalog | union
