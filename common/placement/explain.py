"""Why a pod cannot be placed: one `PendingReason` and a sentence a person can act on.

Checked in this order, cluster-wide first:
1. NO_PROFILE — no GPU in the cluster has a model offering a requested profile (under
   `static-balanced`: no layout slice of it), or no single node has all the requested
   profiles; the message names the catalog models that offer it.
2. NO_MATCHING_NODE — nodeSelector / required affinity / taints / cordons exclude every node,
   or every node that offers the profiles; the message counts the exclusions by cause.
Then each remaining node (it matches and offers every requested profile) gets one class,
and the pod's reason is the most advanced class any node reached — the one that says what
would unblock the pod:

    NODE_RESOURCES > FRAGMENTED > FULL > GPU_UNAVAILABLE

- NODE_RESOURCES: the node's GPUs could host every slice; its free cpu / memory / pods fall
  short (the message says which, the need and the most free).
- FRAGMENTED: the usable GPUs' free slots add up to what the pod needs and count / engine
  limits would allow it, yet no set of legal starts is free; the message lists the free
  slots per GPU, most first, truncated.
- FULL: not even that (the message counts the GPUs that offer the profile, and mentions
  unusable ones).
- GPU_UNAVAILABLE: every GPU on the node that offers a requested profile is unhealthy or in
  MIG-disabled mode.

A node's class depends only on its GPU key and the demand, so it is memoised like the node
search: explaining a pending pod on 1000 nodes costs one lookup per node.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain

from common.placement.model import (
    NodeState,
    Pending,
    PendingReason,
    PodRequest,
    Policy,
    Snapshot,
    gpu_keys,
    parse_hw_key,
)
from common.placement.search import (
    CatalogTables,
    Context,
    Demand,
    gpu_info,
    node_multi,
    node_single,
    prune,
    resources_fit,
)
from common.placement.selectors import Mismatch, mismatch
from common.placement.tables import GpuState, ModelTables
from common.quantity import format_bytes, format_cpu_millis

_MAX_LISTED = 4
_MISMATCH_TEXT = {
    Mismatch.SELECTOR: "fail the nodeSelector",
    Mismatch.AFFINITY: "fail the required node affinity",
    Mismatch.TAINT: "have taints the pod does not tolerate",
    Mismatch.UNSCHEDULABLE: "are cordoned",
}


def _plural(n: int, word: str) -> str:
    return f"{n} {word if n == 1 else word + 's'}"


def _join(items: list[str], last: str = "and") -> str:
    if len(items) <= 1:
        return "".join(items)
    return f"{', '.join(items[:-1])} {last} {items[-1]}"


def _starts_text(starts: tuple[int, ...]) -> str:
    if len(starts) >= 3 and list(starts) == list(range(starts[0], starts[-1] + 1)):
        return f"any start {starts[0]}-{starts[-1]}"
    return "start " + _join([str(s) for s in starts], "or")


def _runs(slots: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3,5" (runs of three or more collapse)."""
    out: list[str] = []
    i = 0
    while i < len(slots):
        j = i
        while j + 1 < len(slots) and slots[j + 1] == slots[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{slots[i]}-{slots[j]}")
        else:
            out.extend(str(x) for x in slots[i : j + 1])
        i = j + 1
    return ",".join(out)


def _demand_text(ctx: Context) -> str:
    return " + ".join(f"{c}x {p}" for p, c in zip(ctx.profiles, ctx.counts, strict=True))


def _mismatch_breakdown(counts: Counter[Mismatch]) -> str:
    return "; ".join(f"{n} {_MISMATCH_TEXT[m]}" for m, n in counts.most_common())


def _offers(t: ModelTables | None, profile: str, policy: Policy) -> bool:
    if t is None or profile not in t.profiles:
        return False
    if policy is Policy.STATIC_BALANCED:
        return any(name == profile for name, _ in t.layout)
    return True


class NodeClass:
    UNAVAILABLE, FULL, FRAGMENTED, FITS = range(4)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one node's GPUs say about the demand (resources and selectors aside)."""

    offered: frozenset[str]  # requested profiles some GPU here offers (any health)
    klass: int  # NodeClass, meaningful when every profile is offered
    free: int  # free slots on the usable GPUs that offer a requested profile
    needed: int  # slots the demand needs at least
    gpu_free: tuple[tuple[int, int], ...]  # (position, free mask) of those GPUs
    models: tuple[str, ...]  # their models
    unusable: int  # GPUs here that offer a requested profile but are unhealthy / MIG off


@lru_cache(maxsize=1 << 12)
def _models_offer(
    ct: CatalogTables, hw_key: str, demand: Demand, policy: Policy
) -> tuple[frozenset[str], int, int]:
    """Requested profiles the node's models offer, how many of its GPUs that offer one are
    unusable, and the fewest slots the demand needs there. Depends on the node's hardware
    only (`NodeState.hw_key`), so it is shared by all nodes of a kind."""
    offered: set[str] = set()
    unusable = 0
    size: dict[str, int] = {}
    for model, ok in parse_hw_key(hw_key):
        t = ct.tables(model)
        mine = [p for p, _ in demand if _offers(t, p, policy)]
        offered.update(mine)
        if mine and not ok:
            unusable += 1
        if t is not None:
            for p, _ in demand:
                if p in t.profiles:
                    size[p] = min(size.get(p, t.profiles[p].size), t.profiles[p].size)
    needed = sum(c * size.get(p, 0) for p, c in demand)
    return frozenset(offered), unusable, needed


@lru_cache(maxsize=1 << 15)
def _gpu_room(
    tables: ModelTables, state: GpuState, profile: str, policy: Policy
) -> tuple[int, int]:
    """How many more `profile` instances the count and engine limits allow on this GPU, and
    the slots such an instance could ever use there."""
    pt = tables.profiles[profile]
    fits = pt.max_count - state.counts[pt.index]
    for have, use, limit in zip(state.engines, pt.engines, tables.full_engines, strict=True):
        if use:
            fits = min(fits, (limit - have) // use)
    if fits <= 0:
        return 0, 0
    if policy is Policy.STATIC_BALANCED:
        reach = 0
        for name, s in tables.layout:
            if name == profile:
                reach |= pt.masks[pt.starts.index(s)]
        return fits, reach
    return fits, (1 << tables.slots) - 1


GpuShare = tuple[frozenset[str], tuple[int, ...], int, str]


@lru_cache(maxsize=1 << 15)
def _gpu_share(ct: CatalogTables, gpu_key: str, demand: Demand, policy: Policy) -> GpuShare | None:
    """One GPU's part of a verdict, memoised on its own key (a node whose one GPU changed
    recomputes that GPU only): the requested profiles it offers, the room for each requested
    profile (in demand order), its free slots such an instance could use, and its model;
    None when it is unusable, of an unknown model, or offers no requested profile."""
    part = gpu_info(ct, gpu_key)[2]
    if part is None:
        return None
    t, st = part[0], part[1]
    mine: list[str] = []
    rooms: list[int] = []
    reach = 0
    for p, _ in demand:
        if not _offers(t, p, policy):
            rooms.append(0)
            continue
        mine.append(p)
        fits, where = _gpu_room(t, st, p, policy)
        rooms.append(fits)
        reach |= where
    if not mine:
        return None
    return frozenset(mine), tuple(rooms), reach & ~st.mask, t.name


@lru_cache(maxsize=1 << 14)
def verdict(
    ct: CatalogTables, node_key: str, hw_key: str, demand: Demand, policy: Policy
) -> Verdict:
    offered, unusable, needed = _models_offer(ct, hw_key, demand, policy)
    gpu_free = []
    models = []
    usable_offered: frozenset[str] = frozenset()
    room = [0] * len(demand)
    for pos, key in enumerate(gpu_keys(node_key)):
        share = _gpu_share(ct, key, demand, policy)
        if share is None:
            continue
        mine, rooms, free_mask, model = share
        usable_offered |= mine
        room = [a + b for a, b in zip(room, rooms, strict=True)]
        gpu_free.append((pos, free_mask))
        models.append(model)
    free = sum(bin(m).count("1") for _, m in gpu_free)
    if len(usable_offered) < len(demand):
        klass = NodeClass.UNAVAILABLE
    elif free < needed or any(r < c for r, (_, c) in zip(room, demand, strict=True)):
        klass = NodeClass.FULL  # a fit needs both (so the exact search is not run)
    else:
        single = demand[0][0] if len(demand) == 1 and demand[0][1] == 1 else None
        fit = (
            node_single(ct, node_key, single, policy)
            if single
            else node_multi(ct, node_key, demand, policy)
        )
        klass = NodeClass.FRAGMENTED if fit is None else NodeClass.FITS
    return Verdict(offered, klass, free, needed, tuple(gpu_free), tuple(models), unusable)


@lru_cache(maxsize=256)
def _verdict_table(ct: CatalogTables, demand: Demand, policy: Policy) -> dict[str, Verdict]:
    """Memo of node key -> verdict for one demand: a plain dict probe in the hot loop (the
    key of a node fixes its hardware too, so hw_key need not be part of it)."""
    return {}


def clear_caches() -> None:
    for f in (_models_offer, _gpu_room, _gpu_share, verdict, _verdict_table):
        f.cache_clear()


class _Diagnosis:
    def __init__(self, snapshot: Snapshot, request: PodRequest, ctx: Context) -> None:
        self.snapshot = snapshot
        self.request = request
        self.ctx = ctx
        self._offered: dict[str, frozenset[str]] = {}

    def offered(self, node: NodeState) -> frozenset[str]:
        """The requested profiles the node's GPU models offer (hardware only: cheap)."""
        key = node.hw_key
        got = self._offered.get(key)
        if got is None:
            ctx = self.ctx
            got = _models_offer(ctx.ct, key, ctx.demand, ctx.policy)[0]
            self._offered[key] = got
        return got

    def offers_all(self, node: NodeState) -> bool:
        return len(self.offered(node)) == len(self.ctx.profiles)

    def run(self) -> Pending:
        ctx, nodes = self.ctx, self.snapshot.nodes
        if ctx.profiles:
            missing = self.no_profile()
            if missing is not None:
                return missing
        matching: list[NodeState] = []
        excluded: Counter[Mismatch] = Counter()
        req = self.request
        filtered = bool(req.node_selector or req.required_affinity)
        for n in nodes:
            m = mismatch(n, req) if filtered or n.taints or n.unschedulable else None
            if m is None:
                matching.append(n)
            else:
                excluded[m] += 1
        if not matching:
            return no_match_pending(len(nodes), excluded)
        if not ctx.profiles:
            return self.node_resources(matching)
        # The hot loop of a Pending decision: flat, two memoised lookups per node.
        offering: list[tuple[NodeState, Verdict]] = []
        by_class: dict[int, list[tuple[NodeState, Verdict]]] = {}
        ct, demand, policy, wanted = ctx.ct, ctx.demand, ctx.policy, len(ctx.profiles)
        offered_by_hw = self._offered
        verdicts = _verdict_table(ct, demand, policy)
        prune(verdicts, self.snapshot.nodes)
        for n in matching:
            hw = n.hw_key
            off = offered_by_hw.get(hw)
            if off is None:
                off = offered_by_hw[hw] = _models_offer(ct, hw, demand, policy)[0]
            if len(off) != wanted:
                continue
            key = n.gpu_key
            v = verdicts.get(key)
            if v is None:
                v = verdicts[key] = verdict(ct, key, hw, demand, policy)
            offering.append((n, v))
            group = by_class.get(v.klass)
            if group is None:
                by_class[v.klass] = [(n, v)]
            else:
                group.append((n, v))
        if not offering:
            why: Counter[Mismatch] = Counter()
            for n in nodes:
                if self.offers_all(n):
                    m = mismatch(n, self.request)
                    if m is not None:
                        why[m] += 1
            return none_offering_pending(ctx, why)
        if NodeClass.FITS in by_class:
            return self.node_resources([n for n, _ in by_class[NodeClass.FITS]])
        if NodeClass.FRAGMENTED in by_class:
            return self.fragmented(by_class[NodeClass.FRAGMENTED])
        if NodeClass.FULL in by_class:
            return self.full(by_class[NodeClass.FULL], offering)
        return self.unavailable(offering)

    def no_profile(self) -> Pending | None:
        ctx = self.ctx
        offered: set[str] = set()
        wanted = len(ctx.profiles)
        for n in self.snapshot.nodes:
            offered |= self.offered(n)
            if len(offered) == wanted:
                return None
        parts = []
        for p in ctx.profiles:
            if p in offered:
                continue
            models = {g.tables_key for n in self.snapshot.nodes for g in n.gpus}
            if ctx.policy is Policy.STATIC_BALANCED and any(
                (t := ctx.tables(m)) is not None and p in t.profiles for m in models
            ):
                parts.append(f"the static all-balanced layout has no {p} slice")
                continue
            in_catalog = [m.name for m in ctx.catalog.models_offering(p)]
            if in_catalog:
                parts.append(
                    f"no GPU model in the cluster offers {p} "
                    f"(the catalog has it on {_join(in_catalog[:3])}"
                    f"{', …' if len(in_catalog) > 3 else ''})"
                )
            else:
                parts.append(f"no GPU model in the cluster offers {p} (no catalog model has it)")
        return Pending(PendingReason.NO_PROFILE, "; ".join(parts)) if parts else None

    # --- messages per class ----------------------------------------------------------
    def profile_shape(self, profile: str) -> str:
        for n in self.snapshot.nodes:
            for g in n.gpus:
                t = self.ctx.tables(g.tables_key)
                if t is not None and profile in t.profiles:
                    return shape_text(self.ctx, t, profile)
        return profile

    def fragmented(self, nodes: list[tuple[NodeState, Verdict]]) -> Pending:
        gpus: list[tuple[int, int, str]] = []
        for order, (n, v) in enumerate(nodes):
            gpus.extend((neg, order, text) for neg, text in free_gpus(n, v))
        gpus.sort()
        listed = [text for _, _, text in gpus[:_MAX_LISTED]]
        shapes = "; ".join(self.profile_shape(p) for p in self.ctx.profiles)
        return fragmented_pending(self.ctx, shapes, listed, len(gpus))

    def full(
        self, nodes: list[tuple[NodeState, Verdict]], offering: list[tuple[NodeState, Verdict]]
    ) -> Pending:
        by_model = Counter(chain.from_iterable(v.models for _, v in nodes))
        best_free = max(v.free for _, v in nodes)
        need = max(v.needed for _, v in nodes)
        unhealthy, disabled = self.unavailable_counts(offering)
        return full_pending(self.ctx, by_model, best_free, need, unhealthy, disabled)

    def unavailable_counts(self, nodes: list[tuple[NodeState, Verdict]]) -> tuple[int, int]:
        """Unhealthy and MIG-disabled GPUs that offer a requested profile."""
        unhealthy = disabled = 0
        for n, v in nodes:
            if v.unusable:
                sick, off = unusable_gpus(n, self.ctx)
                unhealthy += sick
                disabled += off
        return unhealthy, disabled

    def unavailable(self, nodes: list[tuple[NodeState, Verdict]]) -> Pending:
        unhealthy, disabled = self.unavailable_counts(nodes)
        return unavailable_pending(self.ctx, unhealthy, disabled, len(nodes))

    def node_resources(self, nodes: list[NodeState]) -> Pending:
        return resources_pending(self.request, self.ctx, nodes)


# --- the messages, from what a pass over the nodes found (the fleet index keeps the same
# figures per demand shape as nodes change, index.py, and words them with these) ----------


def no_match_pending(nodes: int, excluded: Counter[Mismatch]) -> Pending:
    """No node passes the pod's filters: `excluded` counts the nodes by cause, each cause
    first met in snapshot order before the next (the order ties are told in)."""
    if not nodes:
        return Pending(PendingReason.NO_MATCHING_NODE, "the cluster has no nodes")
    return Pending(
        PendingReason.NO_MATCHING_NODE,
        "no node matches the pod's nodeSelector/affinity/tolerations "
        f"(of {_plural(nodes, 'node')}: {_mismatch_breakdown(excluded)})",
    )


def none_offering_pending(ctx: Context, why: Counter[Mismatch]) -> Pending:
    """No matching node offers every requested profile; `why`: the nodes that do, by the
    filter that excludes them (empty: no node offers them all)."""
    plist = _join(list(ctx.profiles))
    elsewhere = sum(why.values())
    if not elsewhere:
        return Pending(
            PendingReason.NO_PROFILE,
            f"no node has GPUs offering all of {plist} (they exist only on different "
            "nodes, and all slices of a pod go to one node)",
        )
    return Pending(
        PendingReason.NO_MATCHING_NODE,
        "no node that matches the pod's nodeSelector/affinity/tolerations has GPUs "
        f"offering {plist}; the {_plural(elsewhere, 'node')} that do "
        f"{'is' if elsewhere == 1 else 'are'} excluded ({_mismatch_breakdown(why)})",
    )


def shape_text(ctx: Context, t: ModelTables, profile: str) -> str:
    """`3g.40gb needs 4 contiguous slots at start 0 or 4`, as model `t` places it."""
    pt = t.profiles[profile]
    if ctx.policy is Policy.STATIC_BALANCED:
        starts = tuple(sorted(s for name, s in t.layout if name == profile))
    else:
        starts = pt.starts
    slots = "1 slot" if pt.size == 1 else f"{pt.size} contiguous slots"
    return f"{profile} needs {slots} at {_starts_text(starts)}"


def free_gpus(node: NodeState, v: Verdict) -> list[tuple[int, str]]:
    """The node's GPUs with free slots a requested profile could use, as (-slots, text)."""
    out = []
    for pos, free in v.gpu_free:
        if free:
            slots = [i for i in range(free.bit_length()) if free >> i & 1]
            out.append((-len(slots), f"{node.name} gpu{node.gpus[pos].index} {{{_runs(slots)}}}"))
    return out


def fragmented_pending(ctx: Context, shapes: str, listed: list[str], gpus: int) -> Pending:
    """`listed`: the first free GPUs (most free slots first, then snapshot order), of `gpus`."""
    more = gpus - len(listed)
    tail = f", … (+{more} more GPUs)" if more else ""
    pod = f" for {_demand_text(ctx)}" if ctx.counts != (1,) else ""
    return Pending(
        PendingReason.FRAGMENTED,
        f"{shapes}; free slots{pod} are fragmented: {', '.join(listed)}{tail}",
    )


def full_pending(
    ctx: Context, by_model: Counter[str], best_free: int, need: int, unhealthy: int, disabled: int
) -> Pending:
    """`by_model`: the FULL nodes' GPUs that offer a requested profile, by model, in order of
    first appearance; `unhealthy` / `disabled`: over every candidate node."""
    total = sum(by_model.values())
    if len(by_model) == 1:
        what = f"{total} {next(iter(by_model))} GPUs"
    else:
        models = ", ".join(f"{c} {m}" for m, c in by_model.most_common())
        what = f"{total} GPUs ({models})"
    what = f"the only {next(iter(by_model))} GPU" if total == 1 else f"all {what}"
    plist = _join(list(ctx.profiles))
    slot_word = "slot" if best_free == 1 else "slots"
    offer, be = ("offers", "is") if total == 1 else ("offer", "are")
    if ctx.counts == (1,):
        head = f"{what} that {offer} {plist} {be} full"
    else:
        room = f"no node has room for {_demand_text(ctx)}"
        head = f"{room}: {what} that {offer} {plist} {be} too full"
    note = f"; besides, {_unavailable_text(unhealthy, disabled)}" if unhealthy or disabled else ""
    return Pending(
        PendingReason.FULL,
        f"{head} (at most {best_free} free {slot_word} on a node; needs {need}){note}",
    )


def unusable_gpus(node: NodeState, ctx: Context) -> tuple[int, int]:
    """The node's unhealthy and MIG-disabled GPUs that offer a requested profile."""
    unhealthy = disabled = 0
    for g in node.gpus:
        if g.usable:
            continue
        t = ctx.tables(g.tables_key)
        if any(_offers(t, p, ctx.policy) for p in ctx.profiles):
            if not g.healthy:
                unhealthy += 1
            else:
                disabled += 1
    return unhealthy, disabled


def _unavailable_text(unhealthy: int, disabled: int) -> str:
    parts = []
    if unhealthy:
        parts.append(f"{_plural(unhealthy, 'GPU')} unhealthy")
    if disabled:
        noun = "" if unhealthy else ("GPU " if disabled == 1 else "GPUs ")
        parts.append(f"{disabled} {noun}in MIG-disabled mode")
    return ", ".join(parts)


def unavailable_pending(ctx: Context, unhealthy: int, disabled: int, nodes: int) -> Pending:
    plist = _join(list(ctx.profiles))
    where = _plural(nodes, "matching node")
    return Pending(
        PendingReason.GPU_UNAVAILABLE,
        f"{_unavailable_text(unhealthy, disabled)}: no usable GPU offers {plist} "
        f"on the {where} that have it",
    )


def resources_pending(req: PodRequest, ctx: Context, nodes: list[NodeState]) -> Pending:
    """The candidate nodes (whose GPUs could host the pod) are all short of cpu, memory or
    pod slots: say which, the need and the most free."""
    parts: list[str] = []
    names: list[str] = []
    if any(n.cpu_millis_free < req.cpu_millis for n in nodes):
        names.append("cpu")
        most = max(n.cpu_millis_free for n in nodes)
        parts.append(
            f"need {format_cpu_millis(req.cpu_millis)} cpu, most free "
            f"{format_cpu_millis(max(most, 0))}"
        )
    if any(n.memory_bytes_free < req.memory_bytes for n in nodes):
        names.append("memory")
        most = max(n.memory_bytes_free for n in nodes)
        parts.append(
            f"need {format_bytes(req.memory_bytes)} memory, most free {format_bytes(max(most, 0))}"
        )
    if any(n.pods_free < 1 for n in nodes):
        names.append("pods")
        parts.append(f"need 1 pod slot, most free {max(max(n.pods_free for n in nodes), 0)}")
    if not names:  # cannot happen: the engine would have placed the pod
        assert all(resources_fit(n, req) for n in nodes)
        names.append("resources")
        parts.append("unexpected: resources fit")
    where = "candidate node" if ctx.profiles else "matching node"
    count = "the only" if len(nodes) == 1 else f"all {len(nodes)}"
    return Pending(
        PendingReason.NODE_RESOURCES,
        f"node {_join(names)} short on {count} {where}{'s' if len(nodes) != 1 else ''} "
        f"({'; '.join(parts)})",
    )


def explain(snapshot: Snapshot, request: PodRequest, ctx: Context) -> Pending:
    """The reason `request` has no placement in `snapshot` (call only after place failed)."""
    return _Diagnosis(snapshot, request, ctx).run()
