"""Builders for the node agent's unit tests (no tests here): GPUs as NVML would report
them, taken from the catalog."""

from __future__ import annotations

from common.catalog import GpuModel, load_catalog
from nodeagent.model import GpuInfo, ProfileInfo

G0, G1 = "GPU-0000", "GPU-1111"


def gpu(
    index: int, uuid: str, model: str | GpuModel = "H200-141GB", mig: str = "enabled"
) -> GpuInfo:
    """`model`: a catalog name, or a model of its own (a table file's)."""
    m = load_catalog().model(model) if isinstance(model, str) else model
    assert m is not None
    return GpuInfo(
        index=index,
        uuid=uuid,
        name=m.product_names[0],
        pci_device_id=m.pci_device_ids[0],
        minor=index,
        mig_current=mig,
        mig_pending=mig,
        memory_total_mib=m.memory_total_mib,
        model=m.name,
        profiles=tuple(
            ProfileInfo(
                p.name,
                p.id,
                p.enum,
                p.compute_slices,
                p.max_count,
                p.memory_mib,
                p.multiprocessors,
                tuple((s, p.size) for s in p.starts),
                p.engines.as_tuple(),
            )
            for p in m.profiles
        ),
    )
