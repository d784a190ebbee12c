"""PriorityClasses for the tests and benchmarks whose pods preempt one another
(tests/integration/test_allocator_preemption.py, tests/e2e/test_preemption.py, bench/chaos.py).

`ensure_priority_classes(kube, {"low": 100, "high": 1000, "nice": 1000}, never={"nice"})`
creates each class that is not there yet; one already there (made by an earlier test module,
or an earlier run on the same control plane) is kept as it is.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from common.kubeapi import ApiError, Kube, Obj, group_path

PRIORITY_CLASSES = group_path("scheduling.k8s.io/v1", "priorityclasses")


async def ensure_priority_classes(
    kube: Kube, values: Mapping[str, int], *, never: Collection[str] = ()
) -> None:
    """Create a PriorityClass of each name with its value; those in `never` get
    `preemptionPolicy: Never` (they wait in the queue rather than preempt)."""
    unknown = sorted(set(never) - set(values))
    if unknown:
        raise ValueError(f"never: {', '.join(unknown)} not among the classes to create")
    for name, value in values.items():
        body: Obj = {"metadata": {"name": name}, "value": value}
        if name in never:
            body["preemptionPolicy"] = "Never"
        try:
            await kube.create(PRIORITY_CLASSES, body)
        except ApiError as exc:
            if not exc.conflict:
                raise
