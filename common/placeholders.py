"""Autoscaler signals: how InstaSlice names its placeholder pods, and how it knows one.

A placeholder pod stands for a gated pod's demand so that Karpenter sees it
(docs/autoscaling.md); the allocator leaves it out of its node accounting and the admission
webhook leaves it unrewritten. Anyone who can write pods can put the label
`instaslice.io/scale-up-for` on one, so the label alone proves nothing (docs/security.md,
threat model): a pod is taken for a placeholder only when it carries everything InstaSlice
gives its own — the label naming a pod's uid, the name derived from that uid, an owner
reference to that pod, the `app.kubernetes.io/managed-by: instaslice` label, the priority
class `instaslice-placeholder` — and nothing a pod InstaSlice places carries (a claim, the
gate). Each of these a tenant could copy; what it cannot do is create the label, which the
pod policy (manifests/base/policy/validatingadmissionpolicy.yaml) refuses to everyone but
InstaSlice's own identity, on create and on every later change. Who wrote the pod is not
read from `metadata.managedFields`: its manager names are the writer's free choice.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from common.constants import CLAIM_ANNOTATION, GATE_NAME, SCALE_UP_LABEL

# Lowest priority, preemptionPolicy Never (manifests/base/allocator/priorityclass.yaml): a real
# pod pinned where a placeholder holds room preempts it; a placeholder never preempts.
PLACEHOLDER_PRIORITY_CLASS: Final = "instaslice-placeholder"
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "instaslice"


def signal_name(pod_uid: str) -> str:
    """One signal per pod, named after its uid: a create that raced is a 409, not a twin."""
    return f"instaslice-scale-up-{pod_uid}"


def stands_for(obj: Mapping[str, Any]) -> str | None:
    """The uid of the pod `obj` is InstaSlice's autoscaler signal for (a placeholder pod, a
    PodTemplate or a ProvisioningRequest), or None: its label `instaslice.io/scale-up-for`
    names a uid, its name is `signal_name` of that uid, it is labelled managed by InstaSlice
    and owned by pods only, that pod among them."""
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        return None
    labels = meta.get("labels")
    if not isinstance(labels, Mapping) or labels.get(MANAGED_BY_LABEL) != MANAGED_BY:
        return None
    uid = labels.get(SCALE_UP_LABEL)
    if not isinstance(uid, str) or not uid or meta.get("name") != signal_name(uid):
        return None
    owners = meta.get("ownerReferences")
    if not isinstance(owners, list) or not owners:
        return None
    if not all(isinstance(o, Mapping) and o.get("kind") == "Pod" for o in owners):
        return None
    return uid if any(o.get("uid") == uid for o in owners) else None


def is_placeholder(pod: Mapping[str, Any]) -> bool:
    """`pod` is an autoscaler placeholder pod InstaSlice made (see the module docstring)."""
    if stands_for(pod) is None:
        return False
    spec = pod.get("spec")
    if not isinstance(spec, Mapping) or spec.get("priorityClassName") != PLACEHOLDER_PRIORITY_CLASS:
        return False
    annotations = pod["metadata"].get("annotations")
    if isinstance(annotations, Mapping) and CLAIM_ANNOTATION in annotations:
        return False
    gates = spec.get("schedulingGates")
    return not (
        isinstance(gates, list)
        and any(isinstance(g, Mapping) and g.get("name") == GATE_NAME for g in gates)
    )
