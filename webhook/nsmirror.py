"""Mirror the namespace opt-in annotation into the label the webhook selects on.

Users opt a namespace in with the annotation `instaslice.io/enabled: "true"` (docs/contract.md §1);
the MutatingWebhookConfiguration's `namespaceSelector` can only match labels, so this loop
keeps the label `instaslice.io/enabled: "true"` present exactly while the annotation is. The
annotation is the source of truth: a label set by hand without it is removed. The second
opt-in, `instaslice.io/whole-gpu: "true"` (whole GPUs), is mirrored the same way: the
whole-GPU webhook entry selects on it.

An Informer (list + watch) delivers every namespace change; a patch is sent only when the
label disagrees with the annotation, so a steady cluster sees no writes. Failed patches are
retried with backoff through a keyed queue (common.workqueue; the latest state of the
namespace is re-read from the informer cache at retry time), never dropped. Running it in
several replicas is harmless: the merge patch is idempotent, at worst each replica sends it
once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import structlog

from common.constants import ENABLED_KEY, WHOLE_GPU_KEY
from common.kubeapi import ApiError, EventType, Informer, Kube, Obj, core_path
from common.workqueue import KeyedQueue

log = structlog.get_logger("nsmirror")


MIRRORED = (ENABLED_KEY, WHOLE_GPU_KEY)  # annotations copied into labels of the same name


def wanted_label(ns: Obj, key: str = ENABLED_KEY) -> str | None:
    """The label value the namespace should carry for `key`: "true" when its annotation
    says so, else none."""
    meta = ns.get("metadata") or {}
    return "true" if (meta.get("annotations") or {}).get(key) == "true" else None


def label_patch(ns: Obj) -> Obj | None:
    """The merge patch bringing the labels in line with the annotations, or None if they
    are."""
    meta = ns.get("metadata") or {}
    labels = meta.get("labels") or {}
    changes = {
        key: wanted_label(ns, key) for key in MIRRORED if labels.get(key) != wanted_label(ns, key)
    }
    if not changes:
        return None
    return {"metadata": {"labels": changes}}


@dataclass
class _Mirror:
    kube: Kube
    retry_base_s: float
    retry_max_s: float
    informer: Informer = field(init=False)
    queue: KeyedQueue = field(init=False)
    backoff: dict[str, float] = field(default_factory=dict)  # namespaces whose patch failed

    def __post_init__(self) -> None:
        self.informer = Informer(self.kube, core_path("namespaces"), self.on_event, name="nsmirror")
        self.queue = KeyedQueue(self.work, name="nsmirror")

    async def on_event(self, etype: EventType, ns: Obj) -> None:
        if etype != "DELETED" and label_patch(ns) is not None:
            self.queue.kick(ns["metadata"]["name"])

    async def work(self, name: str) -> float | None:
        """Sync one namespace; on failure, the delay before it is tried again (doubling)."""
        if await self.sync(name):
            self.backoff.pop(name, None)
            return None
        delay = self.backoff.get(name, self.retry_base_s)
        self.backoff[name] = min(delay * 2, self.retry_max_s)
        return delay

    async def sync(self, name: str) -> bool:
        """Patch the label of `name` if needed (latest cached state). False: retry later."""
        ns = self.informer.cache.get(name)
        patch = label_patch(ns) if ns is not None else None
        if ns is None or patch is None:
            return True
        try:
            await self.kube.patch(core_path("namespaces", name=name), patch)
        except ApiError as exc:
            if exc.not_found:
                return True
            log.warning("namespace label patch failed", namespace=name, error=str(exc))
            return False
        log.info("namespace label mirrored", namespace=name, label=wanted_label(ns))
        return True


async def run_namespace_mirror(
    kube: Kube,
    *,
    synced: asyncio.Event | None = None,
    retry_base_s: float = 0.2,
    retry_max_s: float = 10.0,
) -> None:
    """Mirror until cancelled. `synced` is set once the first namespace list was handled."""
    mirror = _Mirror(kube, retry_base_s, retry_max_s)
    async with asyncio.TaskGroup() as tg:
        mirror.queue.start(tg)
        tg.create_task(mirror.informer.run(), name="nsmirror-informer")
        if synced is not None:
            await mirror.informer.synced.wait()
            synced.set()
