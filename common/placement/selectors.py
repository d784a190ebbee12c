"""Which nodes a pod may land on: nodeSelector, required node affinity, taints.

Kubernetes semantics (NodeAffinity, TaintToleration and NodeUnschedulable filter plugins):
- nodeSelector: every key=value must be a node label.
- required affinity: OR over terms, AND inside a term; a term with no requirement matches
  nothing. In / NotIn / Exists / DoesNotExist / Gt / Lt (Gt/Lt compare integers; a label
  that is not an integer does not match). `matchFields` is not modelled.
- taints: NoSchedule and NoExecute taints must be tolerated; PreferNoSchedule is a score,
  not a filter, and is ignored. An unschedulable node behaves as if tainted
  `node.kubernetes.io/unschedulable:NoSchedule`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from common.placement.model import (
    NodeSelectorRequirement,
    NodeState,
    PodRequest,
    Taint,
    Toleration,
)

UNSCHEDULABLE_TAINT = Taint("node.kubernetes.io/unschedulable", "", "NoSchedule")


class Mismatch(Enum):
    SELECTOR = "nodeSelector"
    AFFINITY = "affinity"
    TAINT = "taints"
    UNSCHEDULABLE = "unschedulable"


def requirement_ok(req: NodeSelectorRequirement, labels: Mapping[str, str]) -> bool:
    """Whether a node with `labels` meets one node-selector requirement."""
    value = labels.get(req.key)
    op = req.operator
    if op == "In":
        return value is not None and value in req.values
    if op == "NotIn":
        return value is None or value not in req.values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt"):
        if value is None or len(req.values) != 1:
            return False
        try:
            have, want = int(value), int(req.values[0])
        except ValueError:
            return False
        return have > want if op == "Gt" else have < want
    return False  # an unknown operator matches nothing (the API server would reject it)


def tolerates(tolerations: tuple[Toleration, ...], taint: Taint) -> bool:
    for t in tolerations:
        if t.effect and t.effect != taint.effect:
            continue
        if t.operator == "Exists":
            if not t.key or t.key == taint.key:
                return True
        elif t.key == taint.key and t.value == taint.value:
            return True
    return False


def mismatch(node: NodeState, pod: PodRequest) -> Mismatch | None:
    """The first filter that excludes `node` for `pod`, or None when it may run there."""
    labels = node.labels
    for k, v in pod.node_selector.items():
        if labels.get(k) != v:
            return Mismatch.SELECTOR
    if pod.required_affinity and not any(
        term and all(requirement_ok(r, labels) for r in term) for term in pod.required_affinity
    ):
        return Mismatch.AFFINITY
    if node.unschedulable and not tolerates(pod.tolerations, UNSCHEDULABLE_TAINT):
        return Mismatch.UNSCHEDULABLE
    for taint in node.taints:
        if taint.effect != "PreferNoSchedule" and not tolerates(pod.tolerations, taint):
            return Mismatch.TAINT
    return None
