"""Why a pod waits, kept per demand shape as nodes change: explain.py without the pass.

`explain` visits every node to say why a pod fits nowhere: the pod's reason is the most
advanced class any matching node reached, and the message sums figures over the nodes of
that class (explain.py). `ShapeWhy` keeps, for one demand shape (catalog, profiles and
counts, policy), every indexed node's verdict and those sums, per *filter signature* — the
node's taints and cordon, all that a pod without nodeSelector or required affinity reads of
a node. A pending pod then costs the nodes that changed since its shape was last explained,
plus one filter check per signature, plus a few heap pops for the fragmented GPUs it lists;
the words come from explain.py's own message functions, so they are the scan's.

Where the sums cannot give the scan's exact words, `explain` answers None and the caller
runs the scan: a pod with a nodeSelector or required affinity (labels differ per node), a
profile no node offers (NO_PROFILE), a profile whose slot shape differs between the models
present, and ties the scan breaks by which node came first (two exclusion causes, or two
GPU models, with equal counts). All rare on a live fleet.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from common.placement.explain import (
    NodeClass,
    Verdict,
    _models_offer,
    _verdict_table,
    fragmented_pending,
    free_gpus,
    full_pending,
    no_match_pending,
    none_offering_pending,
    resources_pending,
    shape_text,
    unavailable_pending,
    unusable_gpus,
    verdict,
)
from common.placement.lazyheap import Entry, LazyHeap, take
from common.placement.model import NodeState, Pending, PodRequest, Taint, parse_hw_key
from common.placement.search import RANK_TABLE_LIMIT, Context, prune
from common.placement.selectors import Mismatch, mismatch

Sig = tuple[tuple[Taint, ...], bool]  # (taints, unschedulable)
Nodes = dict[str, tuple[NodeState, Any]]  # name -> (state, sort key): the index's nodes
_LISTED = 4  # fragmented GPUs a message lists (explain._MAX_LISTED)


@dataclass(slots=True)
class _Group:
    """One demand shape's sums over the nodes of one filter signature."""

    rep: NodeState  # any node of the signature: what a pod's tolerations are checked on
    nodes: int = 0
    offering: int = 0  # nodes whose GPU models offer every requested profile
    unhealthy: int = 0  # over the offering nodes: their GPUs that offer a requested
    disabled: int = 0  # profile but are unhealthy / MIG-disabled
    fits: set[str] = field(default_factory=set)  # class FITS (GPUs would do)
    fragmented: LazyHeap = field(default_factory=LazyHeap)  # by (-most free slots, key)
    fragmented_nodes: int = 0
    free_gpus: int = 0  # GPUs with free slots on the FRAGMENTED nodes
    full: int = 0
    models: Counter[str] = field(default_factory=Counter)  # FULL nodes' GPUs, by model
    free: Counter[int] = field(default_factory=Counter)  # FULL nodes' Verdict.free values
    needed: Counter[int] = field(default_factory=Counter)  # and Verdict.needed values


@dataclass(frozen=True, slots=True)
class _Record:
    """What one node adds to the sums (subtracted again when it changes)."""

    sig: Sig
    hw: str
    offered: frozenset[str]
    verdict: Verdict | None  # None: its models do not offer every requested profile
    unusable: tuple[int, int]
    # FRAGMENTED: its GPUs with free slots, and the most free slots on one of them (the
    # texts `_fragmented` lists are worded from the verdict there, for the few listed)
    free_gpus: int
    most_free: int
    models: tuple[tuple[str, int], ...]  # FULL: its GPUs' models, counted, first seen first


def _add(counter: Counter[Any], item: Any, n: int) -> None:
    left = counter[item] + n
    if left:
        counter[item] = left
    else:
        del counter[item]


def _tied(counts: Counter[Any]) -> bool:
    """Two entries with one count: the scan orders them by first appearance."""
    values = list(counts.values())
    return len(set(values)) < len(values)


class ShapeWhy:
    def __init__(self, ctx: Context, nodes: Nodes) -> None:
        self.ctx = ctx
        self.shape: Hashable = (ctx.ct, ctx.demand, ctx.policy)
        self.groups: dict[Sig, _Group] = {}
        self.hw: Counter[str] = Counter()  # every node's hardware key
        self.offered: Counter[frozenset[str]] = Counter()  # every node's offered profiles
        self.records: dict[str, _Record] = {}
        self.stale: set[str] = set(nodes)
        self._offers: dict[str, bool] = {}  # hardware key -> it offers every profile
        self.refresh(nodes)

    def touch(self, name: str, node: NodeState | None, before: NodeState | None) -> None:
        """Note that `name` changed (`node`: its new state, None when it left; `before`:
        the state it replaced, None if unknown). A node's record reads its taints and
        cordon, its hardware and, where its models offer every requested profile, its
        GPUs: a change to anything else leaves the record as it is."""
        if (
            before is None
            or node is None
            or node.hw_key != before.hw_key
            or node.taints != before.taints
            or node.unschedulable != before.unschedulable
            or (node.gpu_key != before.gpu_key and self._offers_all(node.hw_key))
        ):
            self.stale.add(name)

    def _offers_all(self, hw_key: str) -> bool:
        found = self._offers.get(hw_key)
        if found is None:
            ctx = self.ctx
            offered = _models_offer(ctx.ct, hw_key, ctx.demand, ctx.policy)[0]
            found = self._offers[hw_key] = len(offered) == len(ctx.profiles)
        return found

    def refresh(self, nodes: Nodes, limit: int | None = None) -> int:
        """Bring the sums up to date with the nodes changed since (at most `limit` of them:
        the index spreads the work over decisions); returns how many were done."""
        stale = self.stale
        if not stale:
            return 0
        ctx = self.ctx
        verdicts = _verdict_table(ctx.ct, ctx.demand, ctx.policy)
        if len(verdicts) > RANK_TABLE_LIMIT:
            prune(verdicts, tuple(n for n, _ in nodes.values()))
        done = len(stale) if limit is None else min(limit, len(stale))
        names, self.stale = take(stale, limit)
        for name in names:
            old = self.records.pop(name, None)
            if old is not None:
                self._count(name, old, None, -1)
            got = nodes.get(name)
            if got is not None:
                record = self._record(got[0], verdicts)
                self.records[name] = record
                self._count(name, record, got[1], +1)
        for g in self.groups.values():
            g.fragmented.compact()
        return done

    def _record(self, node: NodeState, verdicts: dict[str, Verdict]) -> _Record:
        ctx = self.ctx
        hw = node.hw_key
        offered = _models_offer(ctx.ct, hw, ctx.demand, ctx.policy)[0]
        v: Verdict | None = None
        unusable = (0, 0)
        free = most = 0
        models: tuple[tuple[str, int], ...] = ()
        if len(offered) == len(ctx.profiles):
            key = node.gpu_key
            v = verdicts.get(key)
            if v is None:
                v = verdicts[key] = verdict(ctx.ct, key, hw, ctx.demand, ctx.policy)
            if v.unusable:
                unusable = unusable_gpus(node, ctx)
            if v.klass == NodeClass.FRAGMENTED:
                for _, mask in v.gpu_free:
                    if mask:
                        free += 1
                        most = max(most, mask.bit_count())
            elif v.klass == NodeClass.FULL:
                models = tuple(Counter(v.models).items())
        sig = (node.taints, node.unschedulable)
        return _Record(sig, hw, offered, v, unusable, free, most, models)

    def _count(self, name: str, r: _Record, key: Any, sign: int) -> None:
        _add(self.hw, r.hw, sign)
        _add(self.offered, r.offered, sign)
        g = self.groups.get(r.sig)
        if g is None:
            assert sign > 0
            node_taints, unschedulable = r.sig
            rep = NodeState("", {}, node_taints, unschedulable, 0, 0, 0, ())
            g = self.groups[r.sig] = _Group(rep)
        g.nodes += sign
        v = r.verdict
        if v is None:
            return
        g.offering += sign
        g.unhealthy += sign * r.unusable[0]
        g.disabled += sign * r.unusable[1]
        if v.klass == NodeClass.FITS:
            if sign > 0:
                g.fits.add(name)
            else:
                g.fits.discard(name)
        elif v.klass == NodeClass.FRAGMENTED:
            g.fragmented_nodes += sign
            g.free_gpus += sign * r.free_gpus
            if sign > 0 and r.free_gpus:
                g.fragmented.set(name, -r.most_free, key)
            else:
                g.fragmented.discard(name)
        elif v.klass == NodeClass.FULL:
            g.full += sign
            for model, n in r.models:
                _add(g.models, model, sign * n)
            _add(g.free, v.free, sign)
            _add(g.needed, v.needed, sign)

    def explain(self, request: PodRequest, nodes: Nodes) -> Pending | None:
        """explain.explain's answer for `request` (which fits on no indexed node), or None
        where the scan must word it (see the module's docstring)."""
        if request.node_selector or request.required_affinity:
            return None
        self.refresh(nodes)
        ctx = self.ctx
        offered: set[str] = set()
        for profiles in self.offered:
            offered |= profiles
        if len(offered) < len(ctx.profiles):
            return None  # NO_PROFILE
        matching: list[_Group] = []
        excluded: Counter[Mismatch] = Counter()  # nodes by cause
        elsewhere: Counter[Mismatch] = Counter()  # offering nodes by cause
        for g in self.groups.values():
            if not g.nodes:
                continue
            m = mismatch(g.rep, request) if g.rep.taints or g.rep.unschedulable else None
            if m is None:
                matching.append(g)
            else:
                excluded[m] += g.nodes
                if g.offering:
                    elsewhere[m] += g.offering
        if not any(g.nodes for g in matching):
            return None if _tied(excluded) else no_match_pending(sum(excluded.values()), excluded)
        offering = sum(g.offering for g in matching)
        if not offering:
            return None if _tied(elsewhere) else none_offering_pending(ctx, elsewhere)
        if any(g.fits for g in matching):
            fits = [nodes[name][0] for g in matching for name in g.fits]
            return resources_pending(request, ctx, fits)
        unhealthy = sum(g.unhealthy for g in matching)
        disabled = sum(g.disabled for g in matching)
        if any(g.fragmented_nodes for g in matching):
            return self._fragmented(matching, nodes)
        if any(g.full for g in matching):
            by_model: Counter[str] = Counter()
            free: set[int] = set()
            needed: set[int] = set()
            for g in matching:
                by_model.update(g.models)
                free.update(g.free)
                needed.update(g.needed)
            if len(by_model) > 1 and _tied(by_model):
                return None
            return full_pending(ctx, by_model, max(free), max(needed), unhealthy, disabled)
        return unavailable_pending(ctx, unhealthy, disabled, offering)

    def _fragmented(self, matching: list[_Group], nodes: Nodes) -> Pending | None:
        ctx = self.ctx
        shapes = []
        models = {m for hw in self.hw for m, _ in parse_hw_key(hw)}
        for p in ctx.profiles:
            texts = set()
            for m in models:
                t = ctx.tables(m)
                if t is not None and p in t.profiles:
                    texts.add(shape_text(ctx, t, p))
            if len(texts) != 1:
                return None  # the scan names the first node's model's
            shapes.append(texts.pop())
        listed: list[tuple[int, Any, str]] = []  # (-free slots, node key, text), best first
        orders = [g.fragmented.ascending() for g in matching if g.fragmented]
        heads: list[tuple[Entry, int]] = []
        try:
            for i, order in enumerate(orders):
                first = next(order, None)
                if first is not None:
                    heads.append((first, i))
            while heads:
                heads.sort()
                (neg, key, name), i = heads[0]
                if len(listed) >= _LISTED and (neg, key) > listed[_LISTED - 1][:2]:
                    break  # no later node has a GPU as free as the last one listed
                v = self.records[name].verdict
                assert v is not None
                listed.extend((n, key, text) for n, text in free_gpus(nodes[name][0], v))
                listed.sort()
                del listed[_LISTED:]
                after = next(orders[i], None)
                if after is None:
                    heads.pop(0)
                else:
                    heads[0] = (after, i)
        finally:
            for order in orders:
                order.close()
        gpus = sum(g.free_gpus for g in matching)
        return fragmented_pending(ctx, "; ".join(shapes), [t for _, _, t in listed], gpus)
