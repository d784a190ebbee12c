"""Why a pod cannot be placed: one `PendingReason` and a sentence a person can act on.

Checked in this order, cluster-wide first:
1. NO_PROFILE — no GPU in the cluster has a model offering a requested profile (under
   `static-balanced`: no layout slice of it); the message names the catalog models that do.
2. NO_MATCHING_NODE — nodeSelector / required affinity / taints / cordons exclude every node,
   or every node that offers the profiles; the message counts the exclusions by cause.
Then each remaining node (it matches and offers every requested profile) gets one class,
and the pod's reason is the most advanced class any node reached — the one that tells what
would unblock the pod:

    NODE_RESOURCES > FRAGMENTED > FULL > GPU_UNAVAILABLE

- NODE_RESOURCES: the node's GPUs could host every slice; its free cpu / memory / pods fall
  short (the message says which, the need and the most free).
- FRAGMENTED: the usable GPUs' free slots (those the requested profiles can ever reach) add
  up to what the pod needs, yet no set of legal starts is free; the message lists the free
  slots per GPU, largest first, truncated.
- FULL: not even that many free slots; the message counts the GPUs that offer the profile.
- GPU_UNAVAILABLE: every GPU on the node that offers a requested profile is unhealthy or in
  MIG-disabled mode.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from common.placement.model import (
    NodeState,
    Pending,
    PendingReason,
    PodRequest,
    Policy,
    Snapshot,
)
from common.placement.search import Context, resources_fit
from common.placement.selectors import Mismatch, mismatch
from common.quantity import format_bytes, format_cpu_millis

_MAX_LISTED = 4
_MISMATCH_TEXT = {
    Mismatch.SELECTOR: "fail the nodeSelector",
    Mismatch.AFFINITY: "fail the required node affinity",
    Mismatch.TAINT: "have taints the pod does not tolerate",
    Mismatch.UNSCHEDULABLE: "are cordoned",
}


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else (plural or word + 's')}"


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


class _Diagnosis:
    def __init__(self, snapshot: Snapshot, request: PodRequest, ctx: Context) -> None:
        self.snapshot = snapshot
        self.request = request
        self.ctx = ctx

    def offers(self, model: str, profile: str) -> bool:
        t = self.ctx.tables(model)
        if t is None or profile not in t.profiles:
            return False
        if self.ctx.policy is Policy.STATIC_BALANCED:
            return any(name == profile for name, _ in t.layout)
        return True

    def node_offers_all(self, node: NodeState) -> bool:
        return all(any(self.offers(g.model, p) for g in node.gpus) for p in self.ctx.profiles)

    def run(self) -> Pending:
        ctx, nodes = self.ctx, self.snapshot.nodes
        if ctx.profiles:
            missing = self.no_profile()
            if missing is not None:
                return missing
        matching: list[NodeState] = []
        excluded: Counter[Mismatch] = Counter()
        for n in nodes:
            m = mismatch(n, self.request)
            if m is None:
                matching.append(n)
            else:
                excluded[m] += 1
        if not matching:
            if not nodes:
                return Pending(PendingReason.NO_MATCHING_NODE, "the cluster has no nodes")
            return Pending(
                PendingReason.NO_MATCHING_NODE,
                "no node matches the pod's nodeSelector/affinity/tolerations "
                f"(of {_plural(len(nodes), 'node')}: {_mismatch_breakdown(excluded)})",
            )
        offering = [n for n in matching if self.node_offers_all(n)]
        if not offering:
            plist = _join(list(ctx.profiles))
            elsewhere = [n for n in nodes if self.node_offers_all(n)]
            if not elsewhere:
                return Pending(
                    PendingReason.NO_PROFILE,
                    f"no node has GPUs offering all of {plist} (they exist only on different "
                    "nodes, and all slices of a pod go to one node)",
                )
            why: Counter[Mismatch] = Counter()
            for n in elsewhere:
                m = mismatch(n, self.request)
                if m is not None:
                    why[m] += 1
            return Pending(
                PendingReason.NO_MATCHING_NODE,
                "no node that matches the pod's nodeSelector/affinity/tolerations has GPUs "
                f"offering {plist}; the {_plural(len(elsewhere), 'node')} that do "
                f"{'is' if len(elsewhere) == 1 else 'are'} excluded ({_mismatch_breakdown(why)})",
            )
        return self.classify(offering)

    def no_profile(self) -> Pending | None:
        ctx = self.ctx
        models = list(dict.fromkeys(g.model for n in self.snapshot.nodes for g in n.gpus))
        parts = []
        for p in ctx.profiles:
            if any(self.offers(m, p) for m in models):
                continue
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

    # --- per-node classes ------------------------------------------------------------
    def classify(self, offering: list[NodeState]) -> Pending:
        ctx = self.ctx
        if not ctx.profiles:
            return self.node_resources(offering)
        short: list[NodeState] = []
        fragmented: list[NodeState] = []
        full: list[NodeState] = []
        unavailable: list[NodeState] = []
        for n in offering:
            if not self.has_usable_for_each(n):
                unavailable.append(n)
            elif ctx.node_fit(n) is not None:
                short.append(n)
            elif self.reachable_free(n) >= self.needed_slots(n) and self.limits_allow(n):
                fragmented.append(n)
            else:
                full.append(n)
        if short:
            return self.node_resources(short)
        if fragmented:
            return self.fragmented(fragmented)
        if full:
            return self.full(full, offering)
        return self.unavailable(offering)

    def relevant_gpus(self, node: NodeState) -> Iterable[int]:
        for pos, g in enumerate(node.gpus):
            if any(self.offers(g.model, p) for p in self.ctx.profiles):
                yield pos

    def has_usable_for_each(self, node: NodeState) -> bool:
        return all(
            any(g.usable and self.offers(g.model, p) for g in node.gpus) for p in self.ctx.profiles
        )

    def free_reach(self, node: NodeState, pos: int) -> int:
        """Free slots of this GPU if a requested profile could still be added there (below
        its count limit; under static-balanced: the free slots of its layout slices)."""
        g = node.gpus[pos]
        st = self.ctx.state(g)
        t = self.ctx.tables(g.model)
        if st is None or t is None:
            return 0
        reach = 0
        for p in self.ctx.profiles:
            pt = t.profiles.get(p)
            if pt is None or st.counts[pt.index] >= pt.max_count:
                continue
            if self.ctx.policy is Policy.STATIC_BALANCED:
                for name, s in t.layout:
                    if name == p:
                        reach |= pt.masks[pt.starts.index(s)]
            else:
                reach |= (1 << t.slots) - 1
        return reach & ~st.mask

    def limits_allow(self, node: NodeState) -> bool:
        """Whether count and engine limits alone would let the node take every slice (so
        that only slot geometry stands in the way)."""
        for p, need in zip(self.ctx.profiles, self.ctx.counts, strict=True):
            room = 0
            for g in node.gpus:
                st = self.ctx.state(g)
                t = self.ctx.tables(g.model)
                if st is None or t is None or p not in t.profiles:
                    continue
                pt = t.profiles[p]
                fits = pt.max_count - st.counts[pt.index]
                for have, use, limit in zip(st.engines, pt.engines, t.full_engines, strict=True):
                    if use:
                        fits = min(fits, (limit - have) // use)
                room += max(fits, 0)
            if room < need:
                return False
        return True

    def reachable_free(self, node: NodeState) -> int:
        return sum(bin(self.free_reach(node, pos)).count("1") for pos in self.relevant_gpus(node))

    def needed_slots(self, node: NodeState) -> int:
        total = 0
        for p, c in zip(self.ctx.profiles, self.ctx.counts, strict=True):
            sizes = [
                t.profiles[p].size
                for g in node.gpus
                if (t := self.ctx.tables(g.model)) is not None and p in t.profiles
            ]
            total += c * min(sizes)
        return total

    def profile_shape(self, profile: str) -> str:
        for n in self.snapshot.nodes:
            for g in n.gpus:
                t = self.ctx.tables(g.model)
                if t is not None and profile in t.profiles:
                    pt = t.profiles[profile]
                    if self.ctx.policy is Policy.STATIC_BALANCED:
                        starts = tuple(sorted(s for name, s in t.layout if name == profile))
                    else:
                        starts = pt.starts
                    slots = "1 slot" if pt.size == 1 else f"{pt.size} contiguous slots"
                    return f"{profile} needs {slots} at {_starts_text(starts)}"
        return profile

    def fragmented(self, nodes: list[NodeState]) -> Pending:
        gpus: list[tuple[int, int, str]] = []
        for order, n in enumerate(nodes):
            for pos in self.relevant_gpus(n):
                free = self.free_reach(n, pos)
                if free:
                    slots = [i for i in range(free.bit_length()) if free >> i & 1]
                    text = f"{n.name} gpu{n.gpus[pos].index} {{{_runs(slots)}}}"
                    gpus.append((-len(slots), order, text))
        gpus.sort()
        listed = [text for _, _, text in gpus[:_MAX_LISTED]]
        more = len(gpus) - len(listed)
        tail = f", … (+{more} more GPUs)" if more else ""
        shapes = "; ".join(self.profile_shape(p) for p in self.ctx.profiles)
        pod = f" for {_demand_text(self.ctx)}" if self.ctx.counts != (1,) else ""
        return Pending(
            PendingReason.FRAGMENTED,
            f"{shapes}; free slots{pod} are fragmented: {', '.join(listed)}{tail}",
        )

    def full(self, nodes: list[NodeState], offering: list[NodeState]) -> Pending:
        ctx = self.ctx
        by_model: Counter[str] = Counter()
        for n in nodes:
            for pos in self.relevant_gpus(n):
                g = n.gpus[pos]
                if g.usable:
                    by_model[g.model] += 1
        total = sum(by_model.values())
        if len(by_model) == 1:
            what = f"{total} {next(iter(by_model))} GPUs"
        else:
            models = ", ".join(f"{c} {m}" for m, c in by_model.most_common())
            what = f"{total} GPUs ({models})"
        what = f"the only {next(iter(by_model))} GPU" if total == 1 else f"all {what}"
        plist = _join(list(ctx.profiles))
        best_free = max(self.reachable_free(n) for n in nodes)
        need = max(self.needed_slots(n) for n in nodes)
        slot_word = "slot" if best_free == 1 else "slots"
        offer, be = ("offers", "is") if total == 1 else ("offer", "are")
        if ctx.counts == (1,):
            head = f"{what} that {offer} {plist} {be} full"
        else:
            room = f"no node has room for {_demand_text(ctx)}"
            head = f"{room}: {what} that {offer} {plist} {be} too full"
        note = self.unavailable_note(offering)
        return Pending(
            PendingReason.FULL,
            f"{head} (at most {best_free} free {slot_word} on a node; needs {need}){note}",
        )

    def unavailable_counts(self, nodes: list[NodeState]) -> tuple[int, int]:
        unhealthy = disabled = 0
        for n in nodes:
            for pos in self.relevant_gpus(n):
                g = n.gpus[pos]
                if not g.healthy:
                    unhealthy += 1
                elif not g.mig_enabled:
                    disabled += 1
        return unhealthy, disabled

    def unavailable_text(self, unhealthy: int, disabled: int) -> str:
        parts = []
        if unhealthy:
            parts.append(f"{_plural(unhealthy, 'GPU')} unhealthy")
        if disabled:
            noun = "GPU" if not unhealthy else ""
            parts.append(f"{disabled} {noun + ' ' if noun else ''}in MIG-disabled mode")
        return ", ".join(parts)

    def unavailable_note(self, nodes: list[NodeState]) -> str:
        unhealthy, disabled = self.unavailable_counts(nodes)
        if not unhealthy and not disabled:
            return ""
        return f"; besides, {self.unavailable_text(unhealthy, disabled)}"

    def unavailable(self, nodes: list[NodeState]) -> Pending:
        unhealthy, disabled = self.unavailable_counts(nodes)
        plist = _join(list(self.ctx.profiles))
        where = _plural(len(nodes), "matching node")
        return Pending(
            PendingReason.GPU_UNAVAILABLE,
            f"{self.unavailable_text(unhealthy, disabled)}: no usable GPU offers {plist} "
            f"on the {where} that have it",
        )

    def node_resources(self, nodes: list[NodeState]) -> Pending:
        req = self.request
        parts: list[str] = []
        names: list[str] = []
        cpu_short = [n for n in nodes if n.cpu_millis_free < req.cpu_millis]
        mem_short = [n for n in nodes if n.memory_bytes_free < req.memory_bytes]
        pods_short = [n for n in nodes if n.pods_free < 1]
        if cpu_short:
            names.append("cpu")
            most = max(n.cpu_millis_free for n in nodes)
            parts.append(
                f"need {format_cpu_millis(req.cpu_millis)} cpu, most free "
                f"{format_cpu_millis(max(most, 0))}"
            )
        if mem_short:
            names.append("memory")
            most = max(n.memory_bytes_free for n in nodes)
            parts.append(
                f"need {format_bytes(req.memory_bytes)} memory, most free "
                f"{format_bytes(max(most, 0))}"
            )
        if pods_short:
            names.append("pods")
            parts.append(f"need 1 pod slot, most free {max(max(n.pods_free for n in nodes), 0)}")
        if not names:  # cannot happen: the engine would have placed the pod
            assert all(resources_fit(n, req) for n in nodes)
            names.append("resources")
            parts.append("unexpected: resources fit")
        where = "candidate node" if self.ctx.profiles else "matching node"
        count = "the only" if len(nodes) == 1 else f"all {len(nodes)}"
        return Pending(
            PendingReason.NODE_RESOURCES,
            f"node {_join(names)} short on {count} {where}{'s' if len(nodes) != 1 else ''} "
            f"({'; '.join(parts)})",
        )


def explain(snapshot: Snapshot, request: PodRequest, ctx: Context) -> Pending:
    """The reason `request` has no placement in `snapshot` (call only after place failed)."""
    return _Diagnosis(snapshot, request, ctx).run()
