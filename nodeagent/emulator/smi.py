"""What `nvidia-smi mig -lgip` / `-lgipp` print, from the catalog (pure text formatting).

The layout is copied from the real H200 dump in tests/data/h200-141gb/ (byte for byte
there): an 81-column table, two rows per profile (SM/DEC/ENC over CE/JPEG/OFA), memory in
GiB = MiB / 1024 with two decimals (printf rounding), P2P "No", and `Placement :` for a
single start but `Placements:` for several. Profiles come in catalog order, which is the
order of the real dumps. Free counts are the GPU's remaining capacity (all free on an
empty GPU, as with MIG disabled).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.catalog import GpuModel, Profile

_RULE = "+" + "-" * 79 + "+"
_HEADER = (
    _RULE,
    "| GPU instance profiles:" + " " * 56 + "|",
    "| GPU   Name               ID    Instances   Memory     P2P    SM    DEC   ENC  |",
    "|                                Free/Total   GiB              CE    JPEG  OFA  |",
    "|" + "=" * 79 + "|",
)


def _gib(profile: Profile) -> str:
    return f"{profile.memory_mib / 1024:.2f}"


def lgip_rows(gpu: int, profile: Profile, free: int) -> tuple[str, str]:
    e = profile.engines
    top = (
        f"|{gpu:>4}  {'MIG ' + profile.name:<20}{profile.id:>2}   "
        f"{free:>3}/{profile.max_count:<3}      {_gib(profile):<11}{'No':<7}"
        f"{profile.multiprocessors:<7}{e.dec:<6}{e.enc:<4}|"
    )
    bottom = f"|{'':60}{e.ce:>4}{'':5}{e.jpeg:<6}{e.ofa:<4}|"
    return top, bottom


def lgip(gpus: Sequence[tuple[int, GpuModel, Sequence[int] | None]]) -> str:
    """`-lgip` for GPUs given as (index, model, free count per profile or None = all free)."""
    lines = list(_HEADER)
    for index, model, free in gpus:
        for i, profile in enumerate(model.profiles):
            lines.extend(lgip_rows(index, profile, profile.max_count if free is None else free[i]))
            lines.append(_RULE)
    return "\n".join(lines) + "\n"


def lgipp(gpus: Sequence[tuple[int, GpuModel]]) -> str:
    lines = []
    for index, model in gpus:
        for p in model.profiles:
            label = "Placements:" if len(p.starts) > 1 else "Placement :"
            starts = ",".join(str(s) for s in p.starts)
            lines.append(f"GPU {index:>2} Profile ID {p.id:>2} {label} {{{starts}}}:{p.size}")
    return "\n".join(lines) + "\n"
