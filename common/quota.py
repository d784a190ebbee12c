"""Quota in the names users write: memory-slot charges and Kueue's configuration, from the catalog.

Two consumers need the same numbers (docs/kueue.md):
- the webhook, with `--slot-accounting`, adds `instaslice.io/memory-slots` to each
  slice-asking container (so a ResourceQuota `requests.instaslice.io/memory-slots` limits a
  namespace across profiles);
- Kueue, whose resource transformations (generated here) let a ClusterQueue quota be written
  as `nvidia.com/mig-<profile>` whatever name the pod carries when Kueue reads it (Kueue builds
  a plain pod's Workload from the pod as stored, i.e. after InstaSlice's rewrite to
  `instaslice.io/mig-<profile>`, whichever webhook ran first; a Job's Workload from its
  template, which InstaSlice never rewrites), and, with `--slot-accounting` only, charge
  memory slots for Jobs too.

A profile's charge is the *smallest* number of memory slots it takes on any catalog model
(1g.10gb takes 1 slot of 8 on H100-80GB but 2 on A100-40GB): the same number for a pod and for
a Job's template (Kueue's transformations cannot see a selector), exact within one GPU model
(one Kueue ResourceFlavor) for every profile but those few.

Asks whose slots depend on the model are charged the *most* they can hold on a model the pod
may land on (`admitted_models`: its nodeSelector and required node affinity on
`instaslice.io/gpu-model`, else every catalog model), never less than they take (docs/security.md,
finding 8: charging the fewest let a namespace hold more slots than its quota): a whole GPU
its model's slots (the largest catalog model's while the selector leaves the model open), a
size ask the most slots its fitting profile takes on those models. A charge may therefore
exceed what the pod holds; node agents advertise `slot_bound` per GPU so such pods stay
schedulable. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from common.catalog import Catalog, GpuModel
from common.constants import GPU_MODEL_LABEL, MEMORY_SLOTS_RESOURCE, WHOLE_GPU_PROFILE
from common.placement.model import NodeSelectorRequirement
from common.placement.selectors import requirement_ok
from common.profiles import ProfileNameError, instaslice_resource, nvidia_resource
from common.sizing import Size, resolve

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


def admitted_models(catalog: Catalog, spec: Mapping[str, Any]) -> tuple[GpuModel, ...]:
    """The catalog models a pod spec's nodeSelector and required node affinity may admit,
    judged by `instaslice.io/gpu-model` alone (a requirement on any other label, or on a
    field, might hold anywhere). A node without that label (a node of mixed models) may have
    any model, so a selector that admits it admits them all; one that admits no catalog model
    (a model learned from NVML, or none) is charged as if it admitted every one."""
    everything = tuple(catalog.models)
    # each value the label may take on a node: a model's name, or absent (any model)
    values: dict[str | None, tuple[str, ...]] = {m.name: (m.name,) for m in everything}
    values[None] = tuple(m.name for m in everything)
    selector = spec.get("nodeSelector")
    if isinstance(selector, Mapping) and GPU_MODEL_LABEL in selector:
        wanted = selector[GPU_MODEL_LABEL]
        values = {v: names for v, names in values.items() if v == wanted}
    terms = _model_terms(spec)
    if terms is not None:
        values = {
            v: names
            for v, names in values.items()
            if any(
                all(requirement_ok(r, {} if v is None else {GPU_MODEL_LABEL: v}) for r in t)
                for t in terms
            )
        }
    admitted = {n for names in values.values() for n in names}
    return tuple(m for m in everything if m.name in admitted) or everything


def _model_terms(spec: Mapping[str, Any]) -> list[list[NodeSelectorRequirement]] | None:
    """The required node affinity's terms, each reduced to its requirements on
    `instaslice.io/gpu-model` (a term with no requirement at all matches nothing, so it is
    left out); None when the pod has no required node affinity."""
    affinity = spec.get("affinity")
    node = affinity.get("nodeAffinity") if isinstance(affinity, Mapping) else None
    required = (
        node.get("requiredDuringSchedulingIgnoredDuringExecution")
        if isinstance(node, Mapping)
        else None
    )
    raw = required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None
    if not isinstance(raw, list):
        return None
    terms = []
    for t in raw:
        if not isinstance(t, Mapping):
            continue
        exprs = [e for e in t.get("matchExpressions") or [] if isinstance(e, Mapping)]
        if not exprs and not t.get("matchFields"):
            continue
        terms.append(
            [
                NodeSelectorRequirement(
                    GPU_MODEL_LABEL,
                    str(e.get("operator", "")),
                    tuple(str(v) for v in e.get("values") or ()),
                )
                for e in exprs
                if e.get("key") == GPU_MODEL_LABEL
            ]
        )
    return terms


def slot_charge(
    catalog: Catalog,
    asks: Iterable[tuple[str, int]],
    size: Size | None,
    models: Sequence[GpuModel],
) -> int:
    """The memory slots one container is charged: its (profile, count) asks — a whole GPU
    (`profile` "gpu") at the most slots of `models` (`admitted_models`), a profile at its
    `min_slots` — plus its size ask at the most slots its fitting profile takes on `models`
    (on the catalog's models when none of those fits it)."""
    whole = max((m.memory_slots for m in models), default=0)
    total = 0
    for profile, count in asks:
        per = whole if profile == WHOLE_GPU_PROFILE else min_slots(catalog, profile) or 0
        total += per * count
    if size is not None:
        for among in (models, catalog.models):
            fits = [p.memory_slots for m in among if (p := resolve(m, size)) is not None]
            if fits:
                total += max(fits) * size.count
                break
    return total


def slot_bound(catalog: Catalog, gpu_slots: int) -> int:
    """The most memory slots the pods on one GPU of `gpu_slots` slots can be charged: each
    slice takes at least one of its slots and is charged at most a whole GPU of the largest
    model (of the catalog, or this one if larger). A node agent advertises the sum over its
    GPUs, so the kube-scheduler never turns away a pod its GPUs hold."""
    largest = max((m.memory_slots for m in catalog.models), default=0)
    return max(gpu_slots, 1) * max(largest, gpu_slots)


def kueue_resources(catalog: Catalog, *, slot_accounting: bool) -> Obj:
    """The `resources` section of Kueue's Configuration (config.kueue.x-k8s.io/v1beta2).

    Per profile: `instaslice.io/mig-<p>` (a plain pod, rewritten) is *replaced* by
    `nvidia.com/mig-<p>: 1`, so a quota in NVIDIA's names governs it. Only with
    `slot_accounting` (the webhook's `--slot-accounting`) is `instaslice.io/memory-slots`
    charged: a rewritten pod already carries it (the webhook added it), and `nvidia.com/mig-<p>`
    (a Job's template) is *retained* and yields it too. Without it nothing names a resource
    the user never wrote: Kueue refuses a workload whose ClusterQueue does not cover every
    resource it asks (docs/kueue.md), so a queue covering only `nvidia.com/mig-<p>` (and cpu,
    memory) must admit it.
    """
    transformations: list[Obj] = []
    for name, slots in profile_slots(catalog).items():
        transformations.append(
            {
                "input": instaslice_resource(name),
                "strategy": "Replace",
                "outputs": {nvidia_resource(name): "1"},
            }
        )
        if slot_accounting:
            transformations.append(
                {
                    "input": nvidia_resource(name),
                    "strategy": "Retain",
                    "outputs": {MEMORY_SLOTS_RESOURCE: str(slots)},
                }
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
