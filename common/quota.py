"""Quota in the names users write: memory-slot charges and Kueue's configuration, from the catalog.

Two consumers need the same numbers (docs/kueue.md):
- the webhook, with `--slot-accounting`, adds `instaslice.io/memory-slots` to each
  slice-asking container (so a ResourceQuota `requests.instaslice.io/memory-slots` limits a
  namespace across profiles);
- Kueue, whose resource transformations (generated here) let a ClusterQueue quota be written
  as `nvidia.com/mig-<profile>` whatever name the pod carries when Kueue reads it (Kueue builds
  a plain pod's Workload from the pod as stored, i.e. after InstaSlice's rewrite to
  `instaslice.io/mig-<profile>`, whichever webhook ran first; a Job's Workload from its
  template, which InstaSlice never rewrites), and charge memory slots for Jobs too.

A profile's charge is the *smallest* number of memory slots it takes on any catalog model
(1g.10gb takes 1 slot of 8 on H100-80GB but 2 on A100-40GB): a lower bound, so the
kube-scheduler's check against the nodes' advertised slots always holds. Within one GPU model
(one Kueue ResourceFlavor) the charge is exact for every profile but those few. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from common.catalog import Catalog
from common.constants import GPU_MODEL_LABEL, MEMORY_SLOTS_RESOURCE
from common.profiles import ProfileNameError, instaslice_resource, nvidia_resource

Obj = dict[str, Any]


def min_slots(catalog: Catalog, profile: str) -> int | None:
    """The fewest memory slots `profile` takes on any catalog model; None if none offers it."""
    sizes = [p.memory_slots for m in catalog.models if (p := m.profile(profile)) is not None]
    return min(sizes) if sizes else None


def profile_slots(catalog: Catalog) -> dict[str, int]:
    """Every profile that has a resource name (GI profiles), with its `min_slots`."""
    out: dict[str, int] = {}
    for name in sorted(catalog.profile_names()):
        try:
            nvidia_resource(name)
        except ProfileNameError:
            continue
        slots = min_slots(catalog, name)
        assert slots is not None  # the name came from the catalog
        out[name] = slots
    return out


def kueue_resources(catalog: Catalog, *, slot_accounting: bool) -> Obj:
    """The `resources` section of Kueue's Configuration (config.kueue.x-k8s.io/v1beta2).

    Per profile: `instaslice.io/mig-<p>` (a plain pod, rewritten) is *replaced* by
    `nvidia.com/mig-<p>: 1`, and `nvidia.com/mig-<p>` (a Job's template) is *retained*; both
    also yield `instaslice.io/memory-slots` — except that with `slot_accounting` the rewritten
    pod already carries its slots (added by the webhook), so only the Job side adds them.
    """
    transformations: list[Obj] = []
    for name, slots in profile_slots(catalog).items():
        slot_out = {MEMORY_SLOTS_RESOURCE: str(slots)}
        rewritten: Obj = {nvidia_resource(name): "1"}
        if not slot_accounting:
            rewritten |= slot_out
        transformations.append(
            {"input": instaslice_resource(name), "strategy": "Replace", "outputs": rewritten}
        )
        transformations.append(
            {"input": nvidia_resource(name), "strategy": "Retain", "outputs": slot_out}
        )
    return {"transformations": transformations}


def resource_flavors(models: Iterable[str]) -> list[Obj]:
    """One Kueue ResourceFlavor per GPU model, selecting nodes by `instaslice.io/gpu-model`."""
    return [
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": flavor_name(m)},
            "spec": {"nodeLabels": {GPU_MODEL_LABEL: m}},
        }
        for m in models
    ]


def flavor_name(model: str) -> str:
    """A DNS-1123 name for `model`'s flavor: `H100-80GB` → `h100-80gb`."""
    return model.lower().replace("_", "-").replace(".", "-")
