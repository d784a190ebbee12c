"""A fleet index: the same decisions as `engine.place`, without a pass over every node.

`engine.place` scans the whole snapshot for each pod: one memoised lookup per node, so a
decision grows with the fleet (0.4 ms p50 but several ms at p99 on 1000 nodes x 8 GPUs, and
five times that on 5000). The index keeps the fleet ordered the way the `instaslice` policy
ranks it, so a decision touches only the best candidates:

- one slice of a profile: nodes by (single-slice rank, snapshot order) — the scan's own
  preference order; the first node that passes the pod's resource and selector filters is
  the scan's answer;
- several slices: nodes by (lower bound on the loss, snapshot order) — the order in which
  the scan pops its heap — merged lazily from one order per profile, by (loss of one slice
  of it, snapshot order), so a new multi-slice shape costs the nodes it reaches, not the
  fleet; the same bounded search then runs over the first candidates;
- a pod that fits nowhere: the reason from sums kept per demand shape (why.py), the
  explanation's figures brought up to date from the nodes that changed.

Each order is a lazy heap (lazyheap.py), built on the first decision that needs it and
brought up to date at the next decision from the names of the nodes that changed since
(`put` / `remove`, i.e. assume / forget and watch events), so a decision costs a few heap
operations plus the nodes that changed. Ranks and bounds come from the engine's memo tables,
keyed by the node's GPU state, so identical nodes are scored once.

What the index does not cover falls back to the scan over the caller's snapshot, unchanged:
the other policies, a pod without slices, and the pending pods why.py leaves to the scan (a
nodeSelector or required affinity; ties only node order breaks). The seam is narrow on
purpose: the caller feeds node states with a sort key equal to their snapshot order (the
allocator: the node name; the trace replayer: the node's position) and passes a function
that builds the snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Hashable
from heapq import heappop, heappush
from typing import Any

from common.catalog import Catalog
from common.lru import Lru
from common.placement import engine
from common.placement.explain import explain
from common.placement.lazyheap import Entry, LazyHeap, take
from common.placement.model import (
    NodeState,
    Pending,
    Placement,
    PodRequest,
    Policy,
    Snapshot,
    parse_hw_key,
)
from common.placement.search import (
    RANK_SCALE,
    RANK_TABLE_LIMIT,
    CatalogTables,
    Context,
    NodeFit,
    loss_table,
    node_single,
    prune,
    rank_table,
)
from common.placement.selectors import mismatch
from common.placement.why import ShapeWhy

Score = Callable[[str], int]  # node GPU key -> score (lower is better; -1: never fits)
WHY_SHAPES = 8  # pending explanations kept, by demand shape (least recently asked dropped):
# each holds a record per node (135 bytes measured), so 5.4 MB at 5000 nodes when all are kept
WHY_TIDY_NODES = 8  # changed nodes a decision brings into the kept explanations (`_tidy`)
# An order more than ORDER_STALE_KEPT changed nodes behind is brought up to date by every
# decision, ORDER_TIDY_NODES nodes at a time (`_tidy`): the orders asked for often stay
# lazy (a node changed twice between two asks is re-scored once), the rare ones never
# make one decision re-score hundreds of nodes.
ORDER_STALE_KEPT = 16
ORDER_TIDY_NODES = 8


class _Order(LazyHeap):
    """The fleet's nodes that may fit one demand shape, by (score, sort key). `stale`: the
    nodes changed since the order was last brought up to date; `profile`: the one profile
    every node of the order must offer (a node whose hardware offers it nowhere is never
    marked stale: half the fleet, on a fleet of two models)."""

    def __init__(
        self,
        score: Score,
        table: dict[str, int] | None,
        nodes: dict[str, tuple[NodeState, Any]],
        ct: CatalogTables,
        profile: str,
    ) -> None:
        entries: list[Entry] = []
        for name, (node, key) in nodes.items():
            s = score(node.gpu_key)
            if s >= 0:
                entries.append((s, key, name))
        super().__init__(entries)
        self.stale: set[str] = set()
        self._score = score
        self._table = table  # the memo `score` fills, pruned here (None: an lru cache)
        self._ct = ct
        self._profile = profile
        self._hosts: dict[str, bool] = {}  # hardware key -> a usable GPU offers the profile

    def touch(self, name: str, node: NodeState | None) -> None:
        """Note that `name` changed (`node`: its new state, None when it left)."""
        if name in self.live or (node is not None and self.hosts(node.hw_key)):
            self.stale.add(name)

    def hosts(self, hw_key: str) -> bool:
        found = self._hosts.get(hw_key)
        if found is None:
            found = self._hosts[hw_key] = any(
                ok and (t := self._ct.tables(model)) is not None and self._profile in t.profiles
                for model, ok in parse_hw_key(hw_key)
            )
        return found

    def refresh(self, nodes: dict[str, tuple[NodeState, Any]], limit: int | None = None) -> int:
        """Re-score the nodes that changed (at most `limit` of them: the index spreads the
        work over decisions); returns how many were done."""
        stale = self.stale
        if not stale:
            return 0
        table = self._table
        if table is not None and len(table) > RANK_TABLE_LIMIT:
            prune(table, tuple(n for n, _ in nodes.values()))
        done = len(stale) if limit is None else min(limit, len(stale))
        names, self.stale = take(stale, limit)
        score = self._score
        for name in names:
            got = nodes.get(name)
            if got is None or (s := score(got[0].gpu_key)) < 0:
                self.discard(name)
            else:
                self.set(name, s, got[1])
        self.compact()
        return done


class FleetIndex:
    """The fleet's node states, ordered per demand shape for the `instaslice` policy."""

    def __init__(self) -> None:
        self._nodes: dict[str, tuple[NodeState, Any]] = {}  # name -> (state, sort key)
        self._orders: dict[Hashable, _Order] = {}
        self._whys: Lru[Hashable, ShapeWhy] = Lru(WHY_SHAPES)

    def __len__(self) -> int:
        return len(self._nodes)

    def put(self, node: NodeState, key: Any) -> None:
        """Add or replace a node; `key` sorts it as its position in the caller's snapshot."""
        old = self._nodes.get(node.name)
        self._nodes[node.name] = (node, key)
        self._changed(node.name, node, old[0] if old is not None and old[1] == key else None)

    def remove(self, name: str) -> None:
        if self._nodes.pop(name, None) is not None:
            self._changed(name, None, None)

    def _changed(self, name: str, node: NodeState | None, before: NodeState | None) -> None:
        """Mark `name` stale where its change matters. `before`: the state the index held
        under the same sort key (None: none). An order ranks a node by its GPUs alone, so
        a change that leaves them as they were (cpu, memory, pods, taints) re-scores
        nothing; the candidate filters read the node's current state."""
        if before is None or node is None or before.gpu_key != node.gpu_key:
            for order in self._orders.values():
                order.touch(name, node)
        for why in self._whys.values():
            why.touch(name, node, before)

    def place(
        self,
        request: PodRequest,
        policy: Policy,
        catalog: Catalog | None,
        snapshot: Callable[[], Snapshot],
    ) -> Placement | Pending:
        """`engine.place(snapshot(), request, policy, catalog)`, answered from the index
        where it can be; `snapshot()` must list exactly the indexed nodes in key order."""
        self._tidy()
        ctx = Context(catalog, policy, request)
        if policy is not Policy.INSTASLICE or not ctx.profiles:
            return engine.place(snapshot(), request, policy, catalog)
        if ctx.single is not None:
            chosen = self._single(request, ctx, ctx.single)
        else:
            chosen = self._multi(request, ctx)
        if chosen is None:
            return self._explain(request, ctx) or explain(snapshot(), request, ctx)
        return engine.placement_of(chosen[0], chosen[1], request, ctx)

    def _tidy(self) -> None:
        """Bring the kept explanations, and the orders that fell far behind, up to date a few
        nodes per decision, so a pending pod or a rarely asked shape does not pay alone for
        every node changed since it was last asked for."""
        budget = WHY_TIDY_NODES
        for why in self._whys.values():
            budget -= why.refresh(self._nodes, budget)
            if budget <= 0:
                break
        budget = ORDER_TIDY_NODES
        for order in self._orders.values():
            behind = len(order.stale) - ORDER_STALE_KEPT
            if behind > 0:
                budget -= order.refresh(self._nodes, min(budget, behind))
                if budget <= 0:
                    return

    def _explain(self, request: PodRequest, ctx: Context) -> Pending | None:
        """Why the pod fits nowhere, from the sums kept per demand shape (why.py); None
        where only the scan can word it."""
        if request.node_selector or request.required_affinity:
            return None  # labels differ per node: the scan reads them
        shape = (ctx.ct, ctx.demand, ctx.policy)
        why = self._whys.get(shape)
        if why is None:
            why = ShapeWhy(ctx, self._nodes)
            self._whys.put(shape, why)
        return why.explain(request, self._nodes)

    def _order(
        self,
        shape: Hashable,
        score: Score,
        table: dict[str, int] | None,
        ct: CatalogTables,
        profile: str,
    ) -> _Order:
        order = self._orders.get(shape)
        if order is None:
            order = self._orders[shape] = _Order(score, table, self._nodes, ct, profile)
        else:
            order.refresh(self._nodes)
        return order

    def _candidates(
        self, entries: Generator[Entry], request: PodRequest
    ) -> Generator[tuple[int, NodeState]]:
        """The entries' nodes that pass the pod's resource and selector filters."""
        filtered = bool(request.node_selector or request.required_affinity)
        cpu, mem = request.cpu_millis, request.memory_bytes
        nodes = self._nodes
        try:
            for s, _, name in entries:
                node = nodes[name][0]
                if node.pods_free < 1 or node.cpu_millis_free < cpu:
                    continue
                if node.memory_bytes_free < mem:
                    continue
                if (filtered or node.taints or node.unschedulable) and mismatch(node, request):
                    continue
                yield s, node
        finally:
            entries.close()

    def _single(
        self, request: PodRequest, ctx: Context, profile: str
    ) -> tuple[NodeState, NodeFit] | None:
        ct, policy = ctx.ct, ctx.policy
        ranks = rank_table(ct, profile, policy)

        def score(key: str) -> int:
            r = ranks.get(key)
            if r is None:
                fit = node_single(ct, key, profile, policy)
                r = ranks[key] = -1 if fit is None else fit.rank[0] * RANK_SCALE + fit.rank[1]
            return r

        order = self._order(("single", ct, profile, policy), score, ranks, ct, profile)
        candidates = self._candidates(order.ascending(), request)
        try:
            for _, node in candidates:
                fit = node_single(ct, node.gpu_key, profile, policy)
                assert fit is not None
                return node, fit
            return None
        finally:
            candidates.close()

    def _multi(self, request: PodRequest, ctx: Context) -> tuple[NodeState, NodeFit] | None:
        """The engine's bounded search (engine._choose), over the nodes by bound."""
        candidates = self._candidates(self._by_bound(ctx), request)
        try:
            return engine.bounded_search(ctx, candidates)
        finally:
            candidates.close()

    def _losses(self, ct: CatalogTables, profile: str) -> _Order:
        """The nodes by (loss of one `profile` slice there, sort key): one per profile,
        shared by every multi-slice shape that asks for it (`_by_bound`)."""

        losses = loss_table(ct, profile)

        def score(key: str) -> int:
            loss = losses.get(key)
            if loss is None:
                fit = node_single(ct, key, profile, Policy.INSTASLICE)
                loss = losses[key] = -1 if fit is None else fit.loss
            return loss

        return self._order(("loss", ct, profile), score, losses, ct, profile)

    def _by_bound(self, ctx: Context) -> Generator[Entry]:
        """The nodes by (`search.node_bound` of the pod's profiles, sort key) — the order in
        which the scan searches a multi-slice pod — merged lazily from the per-profile loss
        orders, so a shape met for the first time orders no node it does not reach. The
        bound is the largest of the node's per-profile losses, and each order is sorted by
        (loss, key): a node not met yet in any order comes after the largest head of them
        all, so every node met before that head is yielded (Fagin's threshold algorithm). A
        node missing from an order cannot host that profile, and is no candidate."""
        orders = [self._losses(ctx.ct, p) for p in ctx.profiles]
        lives = [o.live for o in orders]
        walks = [o.ascending() for o in orders]
        met: set[str] = set()
        ready: list[Entry] = []  # met candidates, by (bound, key)

        def meet(entry: Entry | None) -> Entry | None:
            if entry is None or entry[2] in met:
                return entry
            name = entry[2]
            met.add(name)
            bound = 0
            for live in lives:
                got = live.get(name)
                if got is None:
                    return entry  # one profile fits nowhere on it
                bound = max(bound, got[0])
            heappush(ready, (bound, entry[1], name))
            return entry

        try:
            heads = [meet(next(walk, None)) for walk in walks]
            while True:
                known = [head for head in heads if head is not None]
                if len(known) < len(heads):
                    while ready:  # an order ran out: every candidate is met
                        yield heappop(ready)
                    return
                top = max(range(len(known)), key=lambda i: known[i][:2])
                threshold = known[top][:2]
                while ready and ready[0][:2] < threshold:
                    yield heappop(ready)
                heads[top] = meet(next(walks[top], None))
        finally:
            for walk in walks:
                walk.close()
