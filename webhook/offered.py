"""Which MIG profiles admission accepts: the catalog's, and any a node agent published.

A GPU model the catalog does not know is still served by its node agent, which publishes
the profiles NVML reports in the node's MigNode (docs/contract.md §3). Admission therefore
accepts a profile when a catalog model offers it *or* some node's MigNode does, and refuses
anything else (a typo) with the list of what the cluster offers. With no MigNode yet (a
fresh cluster, or before the first list arrives) the catalog alone decides, as before.

`OfferedProfiles` is the small, synchronous index (pure; fed by events); `watch_mig_nodes`
is its informer loop, run by every webhook replica (admission is not leader-elected).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from common.constants import MIG_NODE_PAGE_SIZE, MIG_NODE_PLURAL
from common.kubeapi import EventType, Informer, Kube, Obj, identity, instaslice_path
from common.objects import gpu_out_of_bounds


def published_profiles(mig_node: Obj) -> frozenset[str]:
    """The profile names every GPU of a MigNode offers (any GPU, healthy or not, but one
    beyond the MigNode bounds, on which nothing is placed: common.objects.gpu_out_of_bounds)."""
    names: set[str] = set()
    for gpu in (mig_node.get("status") or {}).get("gpus") or []:
        if not isinstance(gpu, dict) or gpu_out_of_bounds(gpu) is not None:
            continue
        for p in gpu.get("profiles") or []:
            if isinstance(p, dict) and isinstance(p.get("name"), str):
                names.add(p["name"])
    return frozenset(names)


class OfferedProfiles:
    """Catalog profiles plus those of every MigNode, kept per node (a node that goes takes
    its profiles with it)."""

    def __init__(self, catalog_profiles: Iterable[str]) -> None:
        self.catalog = frozenset(catalog_profiles)
        self._by_node: dict[str, frozenset[str]] = {}
        # how many nodes offer each name: a node's change costs its own names, not a pass
        # over every node (5000 MigNodes published at start-up were 5000 passes over 5000)
        self._nodes_offering: Counter[str] = Counter()
        self._cluster: frozenset[str] = frozenset()
        self._known: frozenset[str] = self.catalog

    @property
    def known(self) -> frozenset[str]:
        """Every profile admission accepts."""
        return self._known

    @property
    def cluster(self) -> frozenset[str]:
        """The profiles the cluster's nodes published (empty: no MigNode yet)."""
        return self._cluster

    def update(self, etype: EventType, mig_node: Obj) -> None:
        name = str((mig_node.get("metadata") or {}).get("name", ""))
        old = self._by_node.get(name, frozenset())
        new = frozenset() if etype == "DELETED" else published_profiles(mig_node)
        if new == old:
            return
        if new:
            self._by_node[name] = new
        else:
            self._by_node.pop(name, None)
        self._nodes_offering.subtract(old - new)
        self._nodes_offering.update(new - old)
        self._nodes_offering = +self._nodes_offering  # drop the names no node offers
        self._cluster = frozenset(self._nodes_offering)  # as many as there are names
        self._known = self.catalog | self._cluster


async def watch_mig_nodes(kube: Kube, offered: OfferedProfiles) -> None:
    """Keep `offered` in step with the cluster's MigNodes until cancelled."""

    async def on_event(etype: EventType, obj: Obj) -> None:
        offered.update(etype, obj)

    # only names are read: the cache keeps each MigNode's identity, not the object
    path = instaslice_path(MIG_NODE_PLURAL)
    await Informer(
        kube, path, on_event, name="offered", keep=identity, page_size=MIG_NODE_PAGE_SIZE
    ).run()
